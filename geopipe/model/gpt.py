"""A single-device GPT built as a flat list of layers so any contiguous range can be a stage.

Global layer indexing (used by the planner, the pipeline runtime and checkpoints):

* layer ``0`` is ``embed`` (token embedding ``wte`` + learned position embedding ``wpe``),
* layers ``1 .. n_layer`` are ``blocks.0 .. blocks.{n_layer-1}`` (pre-LN transformer blocks),
* layer ``n_layer + 1`` is ``head`` (final LayerNorm ``ln_f`` + ``lm_head``).

Parameter names and initial values depend only on the global layer index, never on how the
model is partitioned, so a checkpoint written by one pipeline layout loads into any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from geopipe.model import recompute as recompute_rule
from geopipe.model import sizes

__all__ = [
    "GPTConfig",
    "GPTStage",
    "layer_name",
    "lm_loss",
    "num_layers",
    "param_count",
]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape; frozen so it can be shared between stages and used as a dict key."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def num_layers(cfg: GPTConfig) -> int:
    """Number of global layers: embed + n_layer blocks + head."""
    return sizes.num_layers(cfg.n_layer)


def layer_name(cfg: GPTConfig, index: int) -> str:
    """Module path prefix of global layer ``index`` ("embed", "blocks.i" or "head")."""
    if not 0 <= index < num_layers(cfg):
        raise ValueError(f"layer index {index} out of range [0, {num_layers(cfg)})")
    if index == 0:
        return "embed"
    if index == num_layers(cfg) - 1:
        return "head"
    return f"blocks.{index - 1}"


def _check_range(cfg: GPTConfig, start: int, end: int) -> None:
    if not 0 <= start < end <= num_layers(cfg):
        raise ValueError(
            f"invalid layer range [{start}, {end}) for a model with {num_layers(cfg)} layers"
        )


def param_count(cfg: GPTConfig, start: int, end: int) -> int:
    """Parameters in global layers [start, end), computed analytically (no allocation)."""
    _check_range(cfg, start, end)
    embed, block, head = sizes.embed_block_head_params(cfg.n_embd, cfg.vocab_size, cfg.block_size)
    total = 0
    for index in range(start, end):
        if index == 0:
            total += embed
        elif index == num_layers(cfg) - 1:
            total += head
        else:
            total += block
    return total


class Embed(nn.Module):
    """Layer 0: token + learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"embed expects LongTensor (B, T), got {tuple(idx.shape)} {idx.dtype}")
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network (4x expansion, GELU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Last layer: final LayerNorm + vocabulary projection.

    The lm_head is deliberately NOT tied to embed.wte: tying would make the first and last
    pipeline stages share one parameter (and its gradient), coupling them across data centres
    and breaking the rule that every parameter name belongs to exactly one global layer.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def _layer_seed(seed: int, index: int) -> int:
    """Generator seed for one global layer; independent of the partition."""
    return (seed * 1_000_003 + index) % (2**63)


@torch.no_grad()
def _init_layer(layer: nn.Module, cfg: GPTConfig, seed: int, index: int) -> None:
    """Initialise one layer from its own generator so any stage matches the full model."""
    gen = torch.Generator(device="cpu").manual_seed(_layer_seed(seed, index))
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    # named_modules() follows registration order, so the draw order is fixed.
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name in ("attn.proj", "mlp.proj") else 0.02
            w = torch.empty(module.weight.shape, dtype=torch.float32)
            module.weight.copy_(w.normal_(0.0, std, generator=gen))
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            w = torch.empty(module.weight.shape, dtype=torch.float32)
            module.weight.copy_(w.normal_(0.0, 0.02, generator=gen))
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


class GPTStage(nn.Module):
    """Global layers [start, end) of a GPT; ``GPTStage(cfg, 0, num_layers(cfg))`` is the full model.

    Attribute layout (``embed``, ``blocks[str(i)]``, ``head``) keeps parameter names such as
    ``blocks.7.attn.qkv.weight`` identical in every pipeline layout.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        start: int,
        end: int,
        seed: int = 0,
        active: tuple[int, int] | None = None,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        _check_range(cfg, start, end)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        recompute_rule.interval(recompute)  # refuse a bad setting before building anything
        self.recompute = recompute
        self.cfg = cfg
        self.start = start
        self.end = end
        self.seed = seed
        # The layers forward runs: all held ones, or (a mixed plan's ZeRO-1 group, see
        # geopipe.runtime.actor.sitegroups) a sub-range, the rest only held for the group.
        self.active = (start, end) if active is None else tuple(active)
        if not start <= self.active[0] < self.active[1] <= end:
            raise ValueError(f"active layers {self.active} are not within [{start}, {end})")
        if start == 0:
            self.embed = Embed(cfg)
            _init_layer(self.embed, cfg, seed, 0)
        self.blocks = nn.ModuleDict()
        for index in range(max(start, 1), min(end, num_layers(cfg) - 1)):
            block = Block(cfg)
            _init_layer(block, cfg, seed, index)
            self.blocks[str(index - 1)] = block
        if end == num_layers(cfg):
            self.head = Head(cfg)
            _init_layer(self.head, cfg, seed, num_layers(cfg) - 1)

    @property
    def has_embed(self) -> bool:
        """True if this stage consumes token ids (it runs layer 0)."""
        return self.active[0] == 0

    @property
    def has_head(self) -> bool:
        """True if this stage produces logits (it runs the last layer)."""
        return self.active[1] == num_layers(self.cfg)

    def layer_of(self, name: str) -> int:
        """The global layer of parameter ``name`` (``embed.*``, ``blocks.<i>.*``, ``head.*``)."""
        head = name.split(".", 1)[0]
        if head == "embed":
            return 0
        if head == "head":
            return num_layers(self.cfg) - 1
        return int(name.split(".")[1]) + 1

    def tied_parameter(self) -> None:
        """The GPT's head is never tied to its embedding (see :class:`Head`)."""
        return None

    def state_aliases(self) -> dict[str, str]:
        """No parameter of the GPT stands in for another (see :class:`HFStage`)."""
        return {}

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (B, T) or hidden state (B, T, n_embd) -> hidden state or logits."""
        a, z = self.active
        if self.has_embed:
            x = self.embed(x)
        elif x.dim() != 3 or x.size(-1) != self.cfg.n_embd:
            raise ValueError(
                f"stage [{a}, {z}) expects hidden state (B, T, {self.cfg.n_embd}), got "
                f"{tuple(x.shape)}"
            )
        for index in range(max(a, 1), min(z, num_layers(self.cfg) - 1)):
            block = self.blocks[str(index - 1)]
            if torch.is_grad_enabled() and recompute_rule.checkpointed(
                self.recompute, index, self.cfg.n_layer
            ):
                # [Note: recompute] in geopipe.model.hf: non-reentrant, so a split backward's
                # torch.autograd.grad (I) recomputes the block as a full backward does.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.has_head:
            x = self.head(x)
        return x

    def extra_repr(self) -> str:
        runs = "" if self.active == (self.start, self.end) else f", active={list(self.active)}"
        again = "" if self.recompute == "none" else f", recompute={self.recompute}"
        return f"layers=[{self.start}, {self.end}){runs}, seed={self.seed}{again}"


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over all B*T positions, computed in fp32 whatever the
    training precision (as `transformers` does: a bf16 softmax over a large vocabulary
    loses the loss's low bits)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
