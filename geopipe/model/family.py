"""One interface for "a stack of layers split into stages": the built-in GPT or a Hugging Face
decoder-only family.

:class:`ModelDesc` is the plain, frozen description the driver ships to every stage actor
(the one conversion from the validated YAML lives in the runtime's placement); the actor
calls :func:`build_stage` to get an ``nn.Module`` for its layers. Both kinds of stage share
the global layer indexing (``0`` embedding, ``1..n`` blocks, ``n + 1`` final norm + head),
``has_embed`` / ``has_head``, ``layer_of(name)`` and partition-independent parameter names,
which is all the engine, checkpoints and recovery rely on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geopipe.model.gpt import GPTConfig, GPTStage
from geopipe.model.hf import HEAD, HFStage, hf_layer_of, hf_meta_model, load_stage_weights
from geopipe.model.hfarch import CONFIG_DEFAULTS

__all__ = ["DTYPES", "ModelDesc", "build_stage", "stage_param_names"]

# Training precision -> the dtype weights and activations are held in on the device.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelDesc:
    """What a stage actor needs to build its layers.

    ``family`` is ``"gpt"`` (the built-in demo model: ``gpt`` holds its :class:`GPTConfig`
    fields) or a `transformers` family (``hf_config`` holds the model's ``config.json``;
    ``weights_dir`` the ``save_pretrained`` directory whose safetensors each stage reads its
    own layers from, or None for a random init from the run's seed).
    """

    family: str
    n_layer: int
    hidden: int
    vocab_size: int
    tie: bool = False
    gpt: dict[str, int] | None = None
    hf_config: dict[str, Any] | None = field(default=None, hash=False)
    weights_dir: str | None = None

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    @property
    def is_gpt(self) -> bool:
        return self.family == "gpt"

    @classmethod
    def from_gpt(cls, cfg: GPTConfig) -> ModelDesc:
        fields = {
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "n_head": cfg.n_head,
            "vocab_size": cfg.vocab_size,
            "block_size": cfg.block_size,
        }
        return cls("gpt", cfg.n_layer, cfg.n_embd, cfg.vocab_size, gpt=fields)

    @classmethod
    def from_hf(cls, config: dict[str, Any], weights_dir: str | None = None) -> ModelDesc:
        return cls(
            family=str(config["model_type"]),
            n_layer=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            vocab_size=int(config["vocab_size"]),
            # Gemma ties by default: an absent key means what its config class assumes.
            tie=bool(config.get("tie_word_embeddings", _tie_default(config))),
            hf_config=dict(config),
            weights_dir=weights_dir,
        )

    def manifest(self) -> dict[str, Any]:
        """The checkpoint manifest's ``model`` entry (export rebuilds the model from it)."""
        if self.is_gpt:
            g = self.gpt or {}
            return {
                "family": "gpt",
                "n_layer": g["n_layer"],
                "n_embd": g["n_embd"],
                "n_head": g["n_head"],
                "vocab_size": g["vocab_size"],
                "max_seq_len": g["block_size"],
            }
        return {
            "family": self.family,
            "n_layer": self.n_layer,
            "n_embd": self.hidden,
            "vocab_size": self.vocab_size,
            "tie_embeddings": self.tie,
            "hf_config": json.loads(json.dumps(self.hf_config)),
        }


def _tie_default(config: dict[str, Any]) -> bool:
    defaults = CONFIG_DEFAULTS.get(str(config.get("model_type")), {})
    return bool(defaults.get("tie_word_embeddings", False))


def build_stage(
    desc: ModelDesc,
    start: int,
    end: int,
    seed: int = 0,
    active: tuple[int, int] | None = None,
    *,
    load_weights: bool = True,
    recompute: str = "none",
) -> nn.Module:
    """Global layers ``[start, end)`` of the model, initialised from ``seed`` per layer, or —
    a `transformers` model with weights — loaded from its safetensors (this stage's tensors
    only); ``recompute`` (``training.recompute``: :mod:`geopipe.model.recompute`) picks the
    blocks its forward runs checkpointed."""
    if desc.is_gpt:
        cfg = GPTConfig(**(desc.gpt or {}))
        return GPTStage(cfg, start, end, seed=seed, active=active, recompute=recompute)
    stage = HFStage(desc.hf_config or {}, start, end, seed=seed, active=active, recompute=recompute)
    if load_weights and desc.weights_dir is not None:
        load_stage_weights(stage, desc.weights_dir)
    return stage


def stage_param_names(desc: ModelDesc, start: int, end: int) -> set[str]:
    """The parameter names a stage of layers ``[start, end)`` holds, without building its
    weights (a `transformers` model's names come from its meta-device template)."""
    if desc.is_gpt:
        return {
            n for n, _ in GPTStage(GPTConfig(**(desc.gpt or {})), start, end).named_parameters()
        }
    names = {n for n, _ in hf_meta_model(desc.hf_config or {}).named_parameters()}
    if desc.tie and start > 0 and end == desc.num_layers:
        names.add(HEAD)  # the head's own copy of the tied embedding
    return {n for n in names if start <= hf_layer_of(n, desc.n_layer) < end}
