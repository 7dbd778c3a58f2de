"""Pipeline stages of a Hugging Face decoder-only causal LM, built from `transformers`' modules.

Any family laid out as ``model.embed_tokens / model.layers[i] / model.norm / lm_head`` with a
rotary-embedding module (:data:`geopipe.model.hfarch.SUPPORTED_FAMILIES`: Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3's text model, Phi-3, OLMo 2; the config layer refuses the others
by name) is cut into geopipe's global layers exactly like the built-in GPT:

* layer ``0`` is ``model.embed_tokens``,
* layers ``1 .. n`` are ``model.layers.0 .. model.layers.{n-1}`` (the family's decoder layer),
* layer ``n + 1`` is ``model.norm`` + ``lm_head``.

Parameter names are `transformers`' own (``model.layers.7.self_attn.q_proj.weight``), the same
in every pipeline layout, so checkpoints re-shard by name and export is a copy.

[Note: modules from the family, not re-implementations]
    The stage deep-copies each piece from the family's own model built on the meta device
    (no memory, no init): the decoder layer, norm, embedding and head come with exactly the
    constructor arguments `transformers` uses (biases, eps, padding index, GQA shapes), so a
    family's quirks inside its modules need no code here. Only the rotary embedding is built
    afresh: its frequencies are buffers computed in ``__init__``, which the meta copy lacks;
    the one other buffer, Gemma's embedding scale, is set from the value its module keeps.

[Note: what the model's forward does, redone per stage]
    The model's own forward does a few things around its modules, and each stage redoes
    them as it does (:class:`geopipe.model.hfarch.Family` says which, per family): the
    attention mask of each layer, made by `transformers`' own mask functions from the same
    config (causal, or the sliding window of Mistral, Phi-3 and the sliding layers of
    Qwen2/Qwen3/Gemma), the rotary tables (Gemma 3: one per attention kind), and Gemma's
    soft-capping of the logits after the head. Attention runs as the model runs it: SDPA,
    or eager where the family's class offers no SDPA (Gemma 2, whose attention scores are
    soft-capped, which SDPA cannot do).

[Note: tied embeddings across stages]
    With ``tie_word_embeddings`` a stage holding both ends shares one parameter, as
    `transformers` does (its name is ``model.embed_tokens.weight``). When the embedding and
    the head sit on different stages each holds a copy, initialised (or loaded) identically;
    the runtime sums the two copies' gradients every step before the optimizer step
    (:meth:`geopipe.runtime.actor.engine.StageEngine.end_iteration`), so both apply the same update
    and stay equal — what Megatron does with its extra all-reduce.

[Note: recompute]
    With ``training.recompute`` (:mod:`geopipe.model.recompute`) a stage runs the chosen
    decoder blocks under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    whenever gradients are on: autograd keeps the block's input (and the arguments it was
    given) instead of its intermediates, and unpacking the first saved tensor in backward
    reruns the block's forward (with the RNG state of the first run). Non-reentrant because
    the reentrant variant supports neither ``torch.autograd.grad`` with ``inputs`` (the split
    backward's ``I``, :mod:`geopipe.runtime.actor.backward`) nor keyword arguments; in this
    variant the gradients flow through the original graph, so the tensor hooks ``W`` relies
    on fire as without recompute, and the recomputed values are bitwise the first ones (the
    same kernels on the same inputs), which the tests check.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from geopipe.model import recompute as recompute_rule
from geopipe.model.hfarch import FAMILIES, SUPPORTED_FAMILIES, Family

__all__ = [
    "EMBED",
    "HEAD",
    "SUPPORTED_FAMILIES",
    "HFStage",
    "hf_config",
    "hf_layer_of",
    "hf_meta_model",
    "load_stage_weights",
]

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def hf_config(config: Mapping[str, Any]) -> Any:
    """A `transformers` config object from a ``config.json`` dict, with SDPA attention (the
    fused kernel the planner's activation model assumes) — or eager attention where the
    family's class offers no SDPA (Gemma 2: SDPA cannot soft-cap attention scores), the
    choice `transformers` itself makes for the model."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not a supported decoder-only family "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    cfg = CONFIG_MAPPING[family].from_dict(dict(config))
    sdpa = getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_sdpa", False)
    cfg._attn_implementation = "sdpa" if sdpa else "eager"
    return cfg


def hf_meta_model(config: Mapping[str, Any]) -> nn.Module:
    """The whole model on the meta device (no memory): the template stages copy from."""
    return _meta_model(json.dumps(dict(config), sort_keys=True))


@lru_cache(maxsize=8)
def _meta_model(config_json: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(json.loads(config_json)))


def hf_layer_of(name: str, n_layer: int) -> int:
    """The global layer of a `transformers` parameter name (see the module docstring)."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) + 1
    if name.startswith(("model.norm.", "lm_head.")):
        return n_layer + 1
    raise ValueError(f"parameter {name!r} belongs to no layer of a decoder-only model")


def _layer_seed(seed: int, index: int) -> int:
    """Generator seed of one global layer (as the built-in GPT's): independent of the layout."""
    return (seed * 1_000_003 + index) % (2**63)


@torch.no_grad()
def _init_layer(module: nn.Module, std: float, seed: int, index: int, norm: float = 1.0) -> None:
    """`transformers`' init for these families (normal(0, initializer_range) for Linear and
    Embedding weights, zero biases, neutral norms: ``norm`` is 1, or 0 for Gemma's
    ``1 + weight`` RMSNorm), drawn from the layer's own generator so any stage equals the
    same layer of the full model."""
    gen = torch.Generator(device="cpu").manual_seed(_layer_seed(seed, index))
    for sub in module.modules():
        if isinstance(sub, nn.Linear | nn.Embedding):
            w = torch.empty(sub.weight.shape, dtype=torch.float32)
            sub.weight.copy_(w.normal_(0.0, std, generator=gen))
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                sub.weight[sub.padding_idx].zero_()
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                sub.bias.zero_()
        elif isinstance(getattr(sub, "weight", None), nn.Parameter):  # RMSNorm and kin
            sub.weight.fill_(norm)


@torch.no_grad()
def _materialise(template: nn.Module) -> nn.Module:
    """A CPU copy of a meta module (storage allocated, parameter values set by the caller).
    Its buffers are set here: Gemma's embedding scale from the float its module keeps; any
    other buffer would hold garbage, so it is refused rather than used."""
    module = copy.deepcopy(template).to_empty(device="cpu")
    for name, sub in module.named_modules():
        for key, buf in sub.named_buffers(recurse=False):
            if key == "embed_scale" and hasattr(sub, "scalar_embed_scale"):
                buf.fill_(float(sub.scalar_embed_scale))
            else:
                where = f"{name}.{key}" if name else key
                raise ValueError(
                    f"{type(template).__name__} holds a buffer {where} that geopipe cannot rebuild"
                )
    return module


class HFStage(nn.Module):
    """Global layers ``[start, end)`` of a `transformers` decoder-only model.

    ``active`` (a sub-range) is what forward runs when a mixed plan's ZeRO-1 group makes this
    replica hold more layers than it runs (as :class:`geopipe.model.gpt.GPTStage`);
    ``recompute`` which blocks run checkpointed ([Note: recompute]).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        start: int,
        end: int,
        seed: int = 0,
        active: tuple[int, int] | None = None,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        recompute_rule.interval(recompute)  # refuse a bad setting before building anything
        self.recompute = recompute
        cfg = hf_config(config)
        self.config_dict = dict(config)
        self.n_layer = int(cfg.num_hidden_layers)
        self.hidden = int(cfg.hidden_size)
        last = self.n_layer + 1
        if not 0 <= start < end <= last + 1:
            raise ValueError(f"invalid layer range [{start}, {end}) for {last + 1} layers")
        self.start, self.end, self.seed = start, end, seed
        self.active = (start, end) if active is None else tuple(active)
        if not start <= self.active[0] < self.active[1] <= end:
            raise ValueError(f"active layers {self.active} are not within [{start}, {end})")
        self.tied = bool(cfg.tie_word_embeddings)
        self._cfg, self._family = cfg, FAMILIES[str(config["model_type"])]
        self._build(cfg, seed)

    def _build(self, cfg: Any, seed: int) -> None:
        """This stage's modules, copied from the meta model and initialised per layer."""
        start, end, last = self.start, self.end, self.n_layer + 1
        meta = hf_meta_model(self.config_dict)
        std = float(cfg.initializer_range)
        norm = 0.0 if self._family.norm_offset else 1.0
        self.model = nn.Module()
        if start == 0:
            self.model.embed_tokens = _materialise(meta.model.embed_tokens)
            _init_layer(self.model.embed_tokens, std, seed, 0)
        self.model.layers = nn.ModuleDict()
        for index in range(max(start, 1), min(end, last)):
            layer = _materialise(meta.model.layers[index - 1])
            _init_layer(layer, std, seed, index, norm)
            self.model.layers[str(index - 1)] = layer
        if max(start, 1) < min(end, last):
            self.model.rotary_emb = type(meta.model.rotary_emb)(config=cfg)
        if end == last + 1:
            self.model.norm = _materialise(meta.model.norm)
            _init_layer(self.model.norm, std, seed, last, norm)
            self.lm_head = _materialise(meta.lm_head)
            if self.tied and start == 0:
                self.lm_head.weight = self.model.embed_tokens.weight
            elif self.tied:  # the copy of the embedding: the same draw as layer 0's
                _init_layer(self.lm_head, std, seed, 0)
            else:
                _init_layer(self.lm_head, std, seed, last)
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        if not self._family.final_softcap:
            self._softcap = None

    @property
    def has_embed(self) -> bool:
        return self.active[0] == 0

    @property
    def has_head(self) -> bool:
        return self.active[1] == self.n_layer + 2

    def layer_of(self, name: str) -> int:
        return hf_layer_of(name, self.n_layer)

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding when the other copy is on another stage
        (see [Note: tied embeddings across stages]); None otherwise."""
        if not self.tied or (self.has_embed and self.has_head):
            return None
        if self.has_embed:
            return self.model.embed_tokens.weight
        return self.lm_head.weight if self.has_head else None

    def state_aliases(self) -> dict[str, str]:
        """Names a saved state may hold instead of this stage's: a tied head's copy equals
        the embedding (a layout with one stage holding both saved only the embedding)."""
        return {HEAD: EMBED} if self.tied else {}

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (B, T) or hidden state (B, T, hidden) -> hidden state or logits."""
        a, z = self.active
        if self.has_embed:
            h = self.model.embed_tokens(x)
        elif x.dim() != 3 or x.size(-1) != self.hidden:
            raise ValueError(
                f"stage [{a}, {z}) expects hidden state (B, T, {self.hidden}), got {tuple(x.shape)}"
            )
        else:
            h = x
        blocks = range(max(a, 1), min(z, self.n_layer + 1))
        if len(blocks):
            h = self._blocks(h, blocks)
        if self.has_head:
            h = self.lm_head(self.model.norm(h))
            if self._softcap is not None:  # as the family's ForCausalLM.forward does
                h = h / self._softcap
                h = torch.tanh(h)
                h = h * self._softcap
        return h

    def _blocks(self, h: Tensor, blocks: range) -> Tensor:
        """The decoder layers ``blocks`` (global indices), each given the mask and rotary
        table of its attention kind as the model's forward gives them ([Note: what the
        model's forward does, redone per stage])."""
        pos = torch.arange(h.size(1), device=h.device).unsqueeze(0)
        kinds = {index: _attention_kind(self._cfg, self._family, index - 1) for index in blocks}
        masks = {kind: _mask(self._cfg, kind, h, pos) for kind in set(kinds.values())}
        if self._family.rope_per_layer_type:
            rope = {kind: self.model.rotary_emb(h, pos, kind) for kind in masks}
        else:
            table = self.model.rotary_emb(h, pos)
            rope = dict.fromkeys(masks, table)
        again = torch.is_grad_enabled()
        for index in blocks:
            kind = kinds[index]
            layer = self.model.layers[str(index - 1)]
            args = {"attention_mask": masks[kind], "position_ids": pos}
            args["position_embeddings"] = rope[kind]
            if again and recompute_rule.checkpointed(self.recompute, index, self.n_layer):
                h = checkpoint(layer, h, use_reentrant=False, **args)  # [Note: recompute]
            else:
                h = layer(h, **args)
        return h

    def extra_repr(self) -> str:
        runs = "" if self.active == (self.start, self.end) else f", active={list(self.active)}"
        again = "" if self.recompute == "none" else f", recompute={self.recompute}"
        return f"layers=[{self.start}, {self.end}){runs}, seed={self.seed}{again}"


def _attention_kind(cfg: Any, family: Family, layer: int) -> str:
    """``full_attention`` or ``sliding_attention``: the mask the model's forward gives decoder
    layer ``layer`` (its ``layer_types``; Mistral and Phi-3: every layer slides when the config
    has a window)."""
    if family.masks == "layer_types":
        return str(cfg.layer_types[layer])
    if family.masks == "window" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _mask(cfg: Any, kind: str, h: Tensor, pos: Tensor) -> Any:
    """The attention mask `transformers`' own mask function makes for ``kind`` with no
    padding and no cache (None where SDPA's causal kernel does it alone), called with the
    arguments this version of `transformers` takes."""
    from transformers import masking_utils

    fn = (
        masking_utils.create_sliding_window_causal_mask
        if kind == "sliding_attention"
        else masking_utils.create_causal_mask
    )
    offered = {
        "config": cfg,
        "inputs_embeds": h,
        "input_embeds": h,
        "attention_mask": None,
        "cache": None,
        "past_key_values": None,
        "position_ids": pos,
        "cache_position": pos[0],
    }
    params = _parameters(fn)
    return fn(**{k: v for k, v in offered.items() if k in params})


@lru_cache(maxsize=4)
def _parameters(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or an index)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{directory}: no model.safetensors or model.safetensors.index.json"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_stage_weights(stage: HFStage, directory: str | Path) -> int:
    """Overwrite ``stage``'s parameters with the pretrained tensors of its own layers only
    (each file is opened lazily; no other layer is read). A tied head with no ``lm_head``
    tensor takes the embedding's. Returns the bytes read."""
    from safetensors import safe_open

    files = _weight_files(Path(directory))
    read = 0
    handles: dict[Path, Any] = {}
    try:
        for name, p in stage.named_parameters():
            source = name if name in files or not (stage.tied and name == HEAD) else EMBED
            if source not in files:
                raise KeyError(f"{directory}: the weights lack {source!r}")
            path = files[source]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt").__enter__()
            t = handles[path].get_tensor(source)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"{path.name}: {source} has shape {tuple(t.shape)}, "
                    f"the model needs {tuple(p.shape)}"
                )
            p.copy_(t.to(p.dtype))
            read += t.numel() * t.element_size()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return read
