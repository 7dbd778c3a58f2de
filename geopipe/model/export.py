"""A trained model out of a geopipe checkpoint into a directory `transformers` loads.

:func:`export_model` turns a checkpoint's parameters (one dict, names as the stages name
them) and its manifest's ``model`` entry into a ``config.json`` dict, a
``generation_config.json`` dict and the tensors under the names
``AutoModelForCausalLM.from_pretrained`` expects; :func:`write_model_dir` writes them
(safetensors, sharded with an index past ``max_shard_bytes``, atomically).

* A `transformers` family (:data:`geopipe.model.hfarch.SUPPORTED_FAMILIES`) already trains
  under its own names: the config is the run's config.json (a config built in code gets the
  family's ``*ForCausalLM`` as its architecture), and a tied ``lm_head.weight`` (the head
  stage's copy of the embedding) is dropped — `transformers` ties it back. Nothing a family
  does in its model's forward (Gemma's embedding scale and soft-capping, sliding windows) is
  baked into the weights, so the exported model computes what the stages computed.
* The built-in GPT becomes ``GPT2LMHeadModel``: the same architecture (learned positions,
  pre-LayerNorm blocks, exact GELU, fused qkv, untied head), with GPT-2's Conv1D weights
  stored transposed.

Pure tensor plumbing (torch and safetensors; no Ray, no transformers): the tests load the
result with `transformers` and compare logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["DTYPES", "ExportError", "export_model", "write_model_dir"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size ("5GB")


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message says which tensor or field."""


def export_model(
    model: Mapping[str, Any], params: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, generation_config.json, tensors) for a checkpoint's ``model`` entry and
    parameters, the tensors cast to ``dtype`` and contiguous."""
    if model.get("family", "gpt") == "gpt":
        config, tensors = _gpt2(model, params)
        eos = bos = None
    else:
        config, tensors = _hf(model, params)
        bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    config["dtype"] = config["torch_dtype"] = _TORCH_NAME[dtype]
    out = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
    generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return config, generation, out


def _hf(
    model: Mapping[str, Any], params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = model.get("hf_config")
    if not isinstance(config, dict):
        raise ExportError("the checkpoint's manifest has no model.hf_config (config.json)")
    config = dict(config)
    family = str(config.get("model_type", model.get("family")))
    if not config.get("architectures"):  # a config built in code rather than loaded
        config["architectures"] = [_CAUSAL_LM.get(family, f"{family.title()}ForCausalLM")]
    tensors = dict(params)
    if model.get("tie_embeddings"):
        tensors.pop("lm_head.weight", None)  # the head's copy: transformers ties it back
    n = int(config["num_hidden_layers"])
    for need in ("model.embed_tokens.weight", "model.norm.weight", f"model.layers.{n - 1}."):
        if not any(k.startswith(need) for k in tensors):
            raise ExportError(f"the checkpoint holds no {need.rstrip('.')} parameters")
    return config, tensors


_CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}

# geopipe GPT name -> GPT-2 name; ``T``: a Linear stored as GPT-2's Conv1D (transposed).
_GPT2_BLOCK = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
_GPT2_OTHER = {
    "embed.wte.weight": "transformer.wte.weight",
    "embed.wpe.weight": "transformer.wpe.weight",
    "head.ln_f.weight": "transformer.ln_f.weight",
    "head.ln_f.bias": "transformer.ln_f.bias",
    "head.lm_head.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _gpt2(
    model: Mapping[str, Any], params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        n_layer, n_embd, n_head = (int(model[k]) for k in ("n_layer", "n_embd", "n_head"))
        vocab, block = int(model["vocab_size"]), int(model["max_seq_len"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"the checkpoint's manifest lacks model field {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in _GPT2_OTHER:
            tensors[_GPT2_OTHER[name]] = t
            continue
        m = _BLOCK.fullmatch(name)
        if m is None or m.group(2) not in _GPT2_BLOCK:
            raise ExportError(f"parameter {name!r} has no GPT-2 counterpart")
        target, transpose = _GPT2_BLOCK[m.group(2)]
        tensors[f"transformer.h.{m.group(1)}.{target}"] = t.t() if transpose else t
    want = len(_GPT2_OTHER) + n_layer * len(_GPT2_BLOCK)
    if len(tensors) != want:
        raise ExportError(f"the checkpoint holds {len(tensors)} GPT tensors, expected {want}")
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": block,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_inner": 4 * n_embd,
        "activation_function": "gelu",  # geopipe's MLP uses exact GELU (F.gelu)
        "layer_norm_epsilon": 1e-5,  # torch.nn.LayerNorm's default
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": False,  # geopipe's GPT head has its own weight
        "scale_attn_weights": True,
        "use_cache": True,
    }
    return config, tensors


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Names grouped into files of at most ``limit`` bytes (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_model_dir(
    out: str | os.PathLike[str],
    config: Mapping[str, Any],
    generation: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a ``save_pretrained``-style directory at ``out`` (which must not exist or be
    empty): built in a temporary sibling and renamed into place, so a failure leaves
    nothing half-written."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
        if generation:
            (tmp / "generation_config.json").write_text(json.dumps(dict(generation), indent=2))
        groups = _shards(tensors, max_shard_bytes)
        meta = {"format": "pt"}
        if len(groups) == 1:
            save_file({k: tensors[k] for k in groups[0]}, tmp / "model.safetensors", meta)
        else:
            weight_map: dict[str, str] = {}
            for i, names in enumerate(groups, 1):
                file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                save_file({k: tensors[k] for k in names}, tmp / file, meta)
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        _readable(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _readable(tmp: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files: give the export the permissions
    a plain ``mkdir`` and ``open`` would (the umask's)."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
