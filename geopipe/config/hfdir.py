"""A `transformers` model directory (``model: {hf: PATH}``), read and checked without
`transformers` or torch: its ``config.json`` gives the model's shape, and its safetensors
headers (parsed here in pure Python) must hold every tensor the family needs, with the
shapes the config implies.

:func:`read_hf_dir` returns the :class:`~geopipe.config.ModelSpec` fields the directory
determines, or raises :class:`HFDirError` naming the problem (the spec reports it at
``model.hf``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from geopipe.model.hfarch import (
    ATTENTION_KINDS,
    CONFIG_DEFAULTS,
    FAMILIES,
    ROPE_REQUIRED,
    SUPPORTED_FAMILIES,
    tensor_shapes,
)

__all__ = ["HFDirError", "read_hf_dir", "safetensors_header"]

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header
MAX_INDEX_BYTES = 64 << 20
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_NOT_WEIGHTS = {"training_args.bin"}  # the Trainer's pickled arguments, not a model
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFDirError(ValueError):
    """The directory cannot be used; the message says why."""


def _int_field(config: dict[str, Any], key: str, family: str, *, low: int = 1) -> int:
    value = config.get(key, CONFIG_DEFAULTS[family].get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HFDirError(f"config.json: {key} must be an integer >= {low} (got {value!r})")
    return value


def _bool_field(config: dict[str, Any], key: str, family: str) -> bool:
    value = config.get(key, CONFIG_DEFAULTS[family].get(key, False))
    if not isinstance(value, bool):
        raise HFDirError(f"config.json: {key} must be true or false (got {value!r})")
    return value


def _read_config(directory: Path) -> tuple[dict[str, Any], bytes]:
    path = directory / "config.json"
    if not directory.is_dir():
        raise HFDirError(f"{directory} is not a directory (a save_pretrained directory)")
    if not path.is_file():
        raise HFDirError(f"{directory} has no config.json (save the model with save_pretrained)")
    with path.open("rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFDirError(f"{path} is larger than {MAX_CONFIG_BYTES >> 10} KiB: not a config.json")
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFDirError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise HFDirError(f"{path} must hold a JSON object")
    return config, raw


def _check_decoder_only(config: dict[str, Any]) -> str:
    """The family of a decoder-only causal LM config; refuses everything else by name."""
    family = config.get("model_type")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFDirError(f"config.json: architectures must be a list of names (got {archs!r})")
    if config.get("is_encoder_decoder"):
        raise HFDirError(
            f"config.json describes an encoder-decoder model (model_type {family!r}); geopipe "
            "trains decoder-only causal LMs"
        )
    other = [a for a in archs if not a.endswith("ForCausalLM")]
    if other:
        raise HFDirError(
            f"config.json describes a {', '.join(other)}, not a decoder-only causal LM "
            "(architectures must end in ForCausalLM)"
        )
    if family not in SUPPORTED_FAMILIES:
        hint = " (for Gemma 3's text model save its gemma3_text part)" if family == "gemma3" else ""
        raise HFDirError(
            f"config.json: model_type {family!r} is not supported{hint} (supported decoder-only "
            f"families: {', '.join(SUPPORTED_FAMILIES)})"
        )
    return family


def _shape_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelSpec fields config.json determines (the family's defaults for absent keys)."""
    heads = _int_field(config, "num_attention_heads", family)
    hidden = _int_field(config, "hidden_size", family)
    kv = config.get("num_key_value_heads", CONFIG_DEFAULTS[family]["num_key_value_heads"])
    kv = heads if kv is None else _int_field(config, "num_key_value_heads", family)
    if heads % kv:
        raise HFDirError(
            f"config.json: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv})"
        )
    head_dim = config.get("head_dim", CONFIG_DEFAULTS[family].get("head_dim"))
    if head_dim is None:
        if hidden % heads:
            raise HFDirError(
                f"config.json: hidden_size ({hidden}) must be divisible by num_attention_heads "
                f"({heads}) when head_dim is not given"
            )
        head_dim = hidden // heads
    else:
        head_dim = _int_field(config, "head_dim", family)
    eps = config.get("rms_norm_eps", CONFIG_DEFAULTS[family]["rms_norm_eps"])
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise HFDirError(f"config.json: rms_norm_eps must be a number in (0, 1) (got {eps!r})")
    biases = FAMILIES[family].biases
    return {
        "family": family,
        "n_layer": _int_field(config, "num_hidden_layers", family),
        "n_embd": hidden,
        "n_head": heads,
        "n_kv_head": kv,
        "head_dim": head_dim,
        "intermediate_size": _int_field(config, "intermediate_size", family),
        "vocab_size": _int_field(config, "vocab_size", family, low=2),
        "tie_embeddings": _bool_field(config, "tie_word_embeddings", family),
        # Qwen2's q/k/v biases are fixed by the family; Llama's, Qwen3's, Gemma's and
        # OLMo 2's come from the config; Mistral and Phi-3 have none.
        "attention_bias": biases == "qkv"
        or (biases in ("llama", "config") and _bool_field(config, "attention_bias", family)),
        "mlp_bias": biases == "llama" and _bool_field(config, "mlp_bias", family),
        "rms_norm_eps": float(eps),
        "max_position_embeddings": _int_field(config, "max_position_embeddings", family, low=2),
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_attention(config: dict[str, Any], fields: dict[str, Any]) -> None:
    """The limits of a family's attention and embedding that `transformers` (or torch) would
    only hit when a stage is built, in its actor: refused here, so the YAML's validation
    (and `geopipe plan`) names them. The sequence length needs no check against a sliding
    window: stages build the family's own window masks (:mod:`geopipe.model.hf`)."""
    family, fam = fields["family"], FAMILIES[fields["family"]]
    vocab, heads = fields["vocab_size"], fields["n_head"]
    pad = config.get("pad_token_id", CONFIG_DEFAULTS[family]["pad_token_id"])
    if pad is not None and (
        isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab
    ):
        raise HFDirError(
            f"config.json: pad_token_id {pad!r} is not a row of the embedding (vocab_size "
            f"{vocab}): the embedding's padding index must be one of its rows, or null"
        )
    if fam.heads_divide_hidden and fields["n_embd"] % heads:
        raise HFDirError(
            f"config.json: hidden_size ({fields['n_embd']}) must be divisible by "
            f"num_attention_heads ({heads}): {family}'s config requires it even with head_dim"
        )
    if config.get("use_bidirectional_attention"):
        raise HFDirError(
            "config.json: use_bidirectional_attention is true: geopipe trains causal LMs"
        )
    window = config.get("sliding_window")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise HFDirError(
            f"config.json: sliding_window must be null or an integer >= 1 (got {window!r})"
        )
    types = config.get("layer_types")
    if fam.masks == "layer_types" and types is not None:
        n = fields["n_layer"]
        if (
            not isinstance(types, list)
            or len(types) != n
            or any(t not in ATTENTION_KINDS for t in types)
        ):
            raise HFDirError(
                f"config.json: layer_types must list {n} attention kinds, one per layer, each "
                f"{' or '.join(ATTENTION_KINDS)} (got {types!r})"
            )
        off = ("sliding_window" in config and window is None) or config.get(
            "use_sliding_window"
        ) is False
        if "sliding_attention" in types and off:
            raise HFDirError(
                "config.json: layer_types has sliding_attention layers but no sliding window "
                "(sliding_window is null or use_sliding_window false)"
            )
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = config.get(key)
        if fam.final_softcap and value is not None and not (_is_number(value) and value > 0):
            raise HFDirError(f"config.json: {key} must be null or a number > 0 (got {value!r})")


def _rope_entries(config: dict[str, Any], family: str) -> list[tuple[str, Any]]:
    """(config.json key, RoPE parameters) of each rotary table: ``rope_parameters`` (or a
    legacy config's ``rope_scaling``), one per attention kind where the family nests them."""
    key = "rope_parameters"
    rope = config.get(key)
    if rope is None and config.get("rope_scaling") is not None:
        key, rope = "rope_scaling", config["rope_scaling"]
    if rope is None:
        return []
    if not isinstance(rope, dict):
        raise HFDirError(f"config.json: {key} must be an object (got {rope!r})")
    if FAMILIES[family].rope_per_layer_type and rope and set(rope) <= set(ATTENTION_KINDS):
        return [(f"{key}.{kind}", entry) for kind, entry in rope.items() if entry is not None]
    return [(key, rope)]


def _check_rope(config: dict[str, Any], fields: dict[str, Any]) -> None:
    """Each rotary table's variant is one the stage supports (:data:`ROPE_REQUIRED`, and the
    family's own list) with the keys `transformers` requires of it, and its numbers have the
    shapes its rotary embedding computes with; the rotary dimension is even."""
    family, fam = fields["family"], FAMILIES[fields["family"]]
    head_dim = fields["head_dim"]
    if family == "phi3":  # Phi-3's rotary dimension ignores head_dim
        head_dim = fields["n_embd"] // fields["n_head"]
    for key, rope in _rope_entries(config, family):
        if not isinstance(rope, dict):
            raise HFDirError(f"config.json: {key} must be an object (got {rope!r})")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if family == "phi3" and kind in ("su", "yarn"):
            kind = "longrope"  # Phi-3's config renames its old names so
        if kind not in fam.rope_types:
            raise HFDirError(
                f"config.json: {key}.rope_type {kind!r} is not a RoPE variant geopipe's "
                f"{family} stages support (supported: {', '.join(fam.rope_types)})"
            )
        missing = [k for k in ROPE_REQUIRED[kind] if k not in rope]
        if missing:
            raise HFDirError(f"config.json: {key} of rope_type {kind!r} lacks {', '.join(missing)}")
        factor = rope.get("factor")
        if factor is not None and not (_is_number(factor) and factor > 0):
            raise HFDirError(f"config.json: {key}.factor must be a number > 0 (got {factor!r})")
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if not (_is_number(partial) and 0 < partial <= 1):
            raise HFDirError(
                f"config.json: partial_rotary_factor must be a number in (0, 1] (got {partial!r})"
            )
        dim = int(head_dim * partial)
        if head_dim > 4 and head_dim % 2 and dim == head_dim:
            raise HFDirError(
                f"config.json: RoPE needs an even rotary dimension; head_dim is {head_dim}"
            )
        for name in ("short_factor", "long_factor") if kind == "longrope" else ():
            value = rope[name]
            if not (
                isinstance(value, list)
                and len(value) == dim // 2
                and all(_is_number(v) for v in value)
            ):
                raise HFDirError(
                    f"config.json: {key}.{name} must be a list of {dim // 2} numbers (half "
                    f"the rotary dimension {dim})"
                )


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (8-byte little-endian length,
    then that many bytes of JSON), checking the data the header points at is in the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFDirError(f"{path.name} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise HFDirError(f"{path.name} is not a safetensors file (header length {n})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HFDirError(f"{path.name}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise HFDirError(f"{path.name}: the safetensors header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(shape, list)
            and all(isinstance(x, int) and x >= 0 for x in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(x, int) for x in offsets)
        ):
            raise HFDirError(f"{path.name}: the header entry of {name!r} is malformed")
        if offsets[1] > data:
            raise HFDirError(
                f"{path.name} is truncated: {name} ends at byte {offsets[1]} of the data, the "
                f"file holds {data}"
            )
        out[name] = tuple(shape)
    return out


def _weights(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of the directory's safetensors weights (one file or an index),
    None when it has no weights; pickle weights are refused."""
    index, single = directory / INDEX, directory / SINGLE
    if index.is_file():
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise HFDirError(f"{INDEX} is larger than {MAX_INDEX_BYTES >> 20} MiB")
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise HFDirError(f"{INDEX} is not a safetensors index (no weight_map)") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise HFDirError(f"{INDEX}: weight_map must map tensor names to file names")
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file or not file.endswith(".safetensors"):
                raise HFDirError(f"{INDEX} names {file!r}: not a .safetensors file beside it")
            if not (directory / file).is_file():
                raise HFDirError(f"{INDEX} names {file}, which is missing")
            header = safetensors_header(directory / file)
            for name in (n for n, f in weight_map.items() if f == file):
                if name not in header:
                    raise HFDirError(f"{INDEX} puts {name} in {file}, which does not hold it")
                shapes[name] = header[name]
        return shapes
    if single.is_file():
        return safetensors_header(single)
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    shards = [f for f in files if f.endswith(".safetensors")]
    if shards:
        raise HFDirError(
            f"safetensors files ({', '.join(shards[:3])}) without {SINGLE} or {INDEX}: "
            "save the model with save_pretrained"
        )
    pickles = [f for f in files if f.endswith(_PICKLE_SUFFIXES) and f not in _NOT_WEIGHTS]
    if pickles:
        raise HFDirError(
            "pickle weights are not loaded; save with safe_serialization=True (found "
            f"{_names(pickles, 3)})"
        )
    return None


def _names(names: list[str], limit: int = 4) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_tensors(shapes: dict[str, tuple[int, ...]], fields: dict[str, Any]) -> None:
    expected = tensor_shapes(SimpleNamespace(**fields))
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise HFDirError(
            f"the safetensors weights lack {len(missing)} tensor{'s' * (len(missing) > 1)} a "
            f"{fields['family']} model of this config needs: {_names(missing)}"
        )
    if "lm_head.weight" in shapes:  # a tied head saved anyway must fit too
        expected["lm_head.weight"] = (fields["vocab_size"], fields["n_embd"])
    wrong = [n for n, s in expected.items() if shapes[n] != s]
    if wrong:
        n = wrong[0]
        raise HFDirError(
            f"{n} has shape {list(shapes[n])} in the weights, config.json implies "
            f"{list(expected[n])}" + (f" ({len(wrong) - 1} more differ)" if len(wrong) > 1 else "")
        )


def read_hf_dir(directory: Path) -> dict[str, Any]:
    """The ModelSpec fields of a ``save_pretrained`` directory (see the module docstring):
    ``family``, ``n_layer``, ``n_embd``, ``n_head``, ``n_kv_head``, ``head_dim``,
    ``intermediate_size``, ``vocab_size``, ``tie_embeddings``, ``attention_bias``,
    ``mlp_bias``, ``rms_norm_eps``, ``hf_weights``, ``hf_config_digest``, and
    ``max_position_embeddings`` (the longest sequence the config allows)."""
    config, raw = _read_config(directory)
    family = _check_decoder_only(config)
    fields = _shape_fields(config, family)
    _check_attention(config, fields)
    _check_rope(config, fields)
    shapes = _weights(directory)
    if shapes is not None:
        _check_tensors(shapes, fields)
    fields["hf_weights"] = shapes is not None
    fields["hf_config_digest"] = hashlib.sha256(raw).hexdigest()
    return fields
