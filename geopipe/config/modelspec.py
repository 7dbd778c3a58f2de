"""``model``: the built-in GPT's shape, or a `transformers` directory (``model.hf``) whose
config.json gives it, with the bounds on every shape field.

Its own module because the model section is the one spec that reads files at validation
(the ``hf`` directory, :mod:`.hfdir`) and fills fields from them, with its own rules about
which fields the YAML may give; the rest of :mod:`.specs` is plain bounded fields.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from geopipe.config.fields import Spec
from geopipe.config.hfdir import HFDirError, read_hf_dir

__all__ = ["HF_ONLY_FIELDS", "HF_SHAPE_FIELDS", "MAX_LAYERS", "ModelSpec"]

# Upper bounds on the model's shape (as on the other per-unit counts in :mod:`.specs`: a typo
# must not make the planner allocate until memory runs out); each is far beyond any real run.
MAX_LAYERS = 10_000  # transformer blocks (the largest published models have ~100-200)
MAX_EMBD = 1 << 17  # hidden size (the largest published models use ~25 k)
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 24  # tokens per sequence

# The shape fields a `model.hf` directory's config.json gives (the YAML may not repeat them),
# and the fields only such a directory sets (the built-in GPT's architecture is fixed).
HF_SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size")
HF_ONLY_FIELDS = (
    "family",
    "n_kv_head",
    "head_dim",
    "intermediate_size",
    "tie_embeddings",
    "attention_bias",
    "mlp_bias",
    "rms_norm_eps",
    "hf_weights",
    "hf_config_digest",
)
MAX_INTERMEDIATE = 1 << 20  # MLP width (the largest published models use ~50-100 k)


def _model_error(field: str, message: str, value: Any) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("model_hf", "{problem}", {"problem": message}),
        loc=(field,),
        input=value,
    )


class ModelSpec(Spec):
    """The model to train: the built-in GPT (its shape given here, ``family == "gpt"``) or a
    `transformers` decoder-only model, ``hf: PATH`` to a ``save_pretrained`` directory (relative
    to the YAML file's directory; stored absolute) whose config.json gives every shape field.

    With ``hf``: ``family`` is config.json's ``model_type`` (one of
    :data:`geopipe.model.hfarch.SUPPORTED_FAMILIES`); ``n_layer``, ``n_embd``, ``n_head``,
    ``vocab_size``, ``n_kv_head``, ``head_dim``, ``intermediate_size``, ``tie_embeddings``,
    ``attention_bias`` and ``mlp_bias`` (each family's rule: :mod:`geopipe.model.hfarch`),
    ``rms_norm_eps`` come from it (the family's
    defaults for absent keys, as `transformers` fills them); ``max_seq_len`` may be given, at
    most (and by default) ``max_position_embeddings``; ``hf_weights`` says the directory has
    safetensors weights (checked to hold every tensor the family needs), and
    ``hf_config_digest`` is the sha256 of config.json's bytes. Without ``hf`` those fields are
    None (``tie_embeddings`` and ``hf_weights`` false) and may not be given.
    """

    hf: str | None = Field(
        None,
        description="a save_pretrained directory of a decoder-only model of a supported family "
        "(geopipe.model.hfarch.SUPPORTED_FAMILIES; relative to the YAML file); its "
        "config.json gives the shape",
    )
    family: str = Field("gpt", description="'gpt' (built in) or config.json's model_type")
    n_layer: int = Field(ge=1, le=MAX_LAYERS)
    n_embd: int = Field(ge=8, le=MAX_EMBD)
    n_head: int = Field(ge=1, le=MAX_EMBD)
    vocab_size: int = Field(256, ge=2, le=MAX_VOCAB)
    max_seq_len: int = Field(ge=2, le=MAX_SEQ_LEN)
    n_kv_head: int | None = Field(None, ge=1, le=MAX_EMBD)
    head_dim: int | None = Field(None, ge=1, le=MAX_EMBD)
    intermediate_size: int | None = Field(None, ge=1, le=MAX_INTERMEDIATE)
    tie_embeddings: bool = False
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    rms_norm_eps: float | None = None
    hf_weights: bool = False
    hf_config_digest: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_hf(cls, data: Any, info: ValidationInfo) -> Any:
        """Fill the fields a `model.hf` directory determines (:mod:`.hfdir`); refuse the
        fields the YAML may not give alongside it (or without it)."""
        if not isinstance(data, dict):
            return data
        hf = data.get("hf")
        if hf is None:
            errors = [
                _model_error(
                    k,
                    "only a model.hf directory's config.json sets this (the "
                    "built-in GPT has a fixed architecture)",
                    data[k],
                )
                for k in HF_ONLY_FIELDS
                if k in data and not (k == "family" and data[k] == "gpt")
            ]
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)
            return data
        if not isinstance(hf, str) or not hf.strip():
            raise ValidationError.from_exception_data(
                cls.__name__, [_model_error("hf", "must be the path of a directory", hf)]
            )
        errors = [
            _model_error(k, "comes from config.json of the model.hf directory: remove it", data[k])
            for k in (*HF_SHAPE_FIELDS, *HF_ONLY_FIELDS)
            if k in data
        ]
        base = (info.context or {}).get("base_dir") if info.context else None
        directory = Path(os.path.abspath(Path(base or ".") / Path(hf).expanduser()))
        try:
            fields = read_hf_dir(directory)
        except HFDirError as exc:
            errors.append(_model_error("hf", str(exc), hf))
            fields = None
        except OSError as exc:
            errors.append(_model_error("hf", f"cannot read {directory}: {exc.strerror or exc}", hf))
            fields = None
        seq = data.get("max_seq_len")
        if fields is not None:
            most = fields.pop("max_position_embeddings")
            if seq is None:
                seq = most
            elif isinstance(seq, int) and not isinstance(seq, bool) and seq > most:
                errors.append(
                    _model_error(
                        "max_seq_len",
                        f"{seq} is longer than the model's max_position_embeddings "
                        f"({most}) in config.json",
                        seq,
                    )
                )
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        out = {**data, **(fields or {}), "hf": str(directory)}
        if seq is not None:
            out["max_seq_len"] = seq
        return out

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.family == "gpt" and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self

    @property
    def is_hf(self) -> bool:
        """A `transformers` model (``hf`` set), not the built-in GPT."""
        return self.family != "gpt"
