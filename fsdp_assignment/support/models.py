"""Models for the tests and benchmarks (provided code, not a task).

Every model here follows one rule that Task 1 (meta-device init) relies on:

    A module that owns parameters or buffers directly defines ``reset_parameters()``, which initializes
    exactly those (not its children's), and its eager ``__init__`` calls it right after creating them,
    before creating any child module. Children are created in the order they are assigned.

torch's own layers (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``) already follow it.

The tests' sizes are deliberately awkward: no unit's parameter count divides by 3 or 4, so padding is exercised
for every world size from 2 to 4. The benchmarks' GPT (``GPTConfig`` at their default sizes) is not: its unit
sizes divide by 4, so it has no padding at W = 2 or 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# --------------------------------------------------------------------------------------------------------
# ToyMLP: nested modules, a frozen parameter, a buffer, and (optionally) a parameter that forward never uses
# --------------------------------------------------------------------------------------------------------
class ScaledResidual(nn.Module):
    """x + scale * inner(x). ``inner`` is a nested Sequential (a candidate for a nested FSDP unit)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        # Own parameters first, initialized at once, then children (the rule in the module docstring).
        # A frozen parameter living in the same unit as trainable ones.
        self.gate = nn.Parameter(torch.empty(dim), requires_grad=False)
        # A persistent buffer: meta-device init must restore it too.
        self.register_buffer("scale", torch.empty(dim))
        self.reset_parameters()
        self.inner = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.uniform_(self.gate, 0.5, 1.5)
            self.scale.copy_(torch.linspace(0.5, 1.0, self.scale.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.gate * self.inner(self.norm(x))


class ToyMLP(nn.Module):
    def __init__(self, d_in: int = 13, dim: int = 29, hidden: int = 37, d_out: int = 7, n_blocks: int = 3,
                 with_unused: bool = False):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(ScaledResidual(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, d_out)
        # Trainable but never used in forward: FSDP must neither hang nor invent a gradient for it.
        self.unused = nn.Linear(dim, 3) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# --------------------------------------------------------------------------------------------------------
# TiedModel: an embedding and an output head that share one weight
# --------------------------------------------------------------------------------------------------------
class TiedModel(nn.Module):
    def __init__(self, vocab: int = 23, dim: int = 11, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter under two names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


# --------------------------------------------------------------------------------------------------------
# GPT: a small GPT-2-style transformer (pre-LayerNorm blocks, causal attention, tied head)
# --------------------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab_size: int = 97
    block_size: int = 16
    n_layer: int = 3
    n_head: int = 2
    n_embd: int = 38
    # Activation checkpointing (torch.utils.checkpoint): "" off, "block" around each block (the usual FSDP
    # unit), "mlp" around each block's MLP (inside the unit); ``checkpoint_reentrant`` picks the variant.
    checkpoint: str = ""
    checkpoint_reentrant: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def _checkpointed(module: nn.Module, x: torch.Tensor, cfg: GPTConfig, where: str) -> torch.Tensor:
    """``module(x)``, under activation checkpointing when ``cfg.checkpoint == where`` and autograd records."""
    if cfg.checkpoint == where and torch.is_grad_enabled():
        return checkpoint(module, x, use_reentrant=cfg.checkpoint_reentrant)
    return module(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + _checkpointed(self.mlp, self.ln_2(x), self.cfg, "mlp")


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, and a head tied to ``wte``.

    The usual FSDP wrapping: each block is a unit; the root unit holds the embeddings, ``ln_f`` and the head.
    """

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = _checkpointed(block, x, self.cfg, "block")
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(cfg: GPTConfig, batch_size: int, seed: int, device: torch.device | str = "cpu"):
    """A deterministic batch of token ids and next-token targets (same values on every machine)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


# --------------------------------------------------------------------------------------------------------
# LoRA: every block keeps a frozen base weight and a small trainable low-rank adapter
# --------------------------------------------------------------------------------------------------------
@dataclass
class LoRAConfig:
    vocab_size: int = 37
    block_size: int = 8
    n_layer: int = 6
    n_embd: int = 29
    hidden: int = 43
    rank: int = 3
    freeze_embedding: bool = False  # True: the first block's input needs no gradient


class LoRALinear(nn.Module):
    """``base(x) + lora_b(lora_a(x))``: ``base`` is a frozen ``nn.Linear``, ``lora_a``/``lora_b`` a trainable
    rank-``rank`` adapter. Unlike LoRA's paper, ``lora_b`` is not initialized to zero, so that both adapter
    matrices get a nonzero gradient from the first step (the tests compare those gradients)."""

    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRABlock(nn.Module):
    """A pre-norm residual MLP block whose two linear layers are LoRALinear; its LayerNorm is frozen too, so
    the block's only trainable parameters are the adapters."""

    def __init__(self, cfg: LoRAConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.ln.requires_grad_(False)
        self.fc = LoRALinear(cfg.n_embd, cfg.hidden, cfg.rank)
        self.proj = LoRALinear(cfg.hidden, cfg.n_embd, cfg.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class LoRAModel(nn.Module):
    """Embedding, ``n_layer`` LoRABlocks, final LayerNorm and head (all trainable, except the embedding with
    ``freeze_embedding``). The usual FSDP wrapping makes each block a unit: every unit then holds a frozen
    FlatParameter (base weights, LayerNorm) beside a small trainable one (the adapters)."""

    def __init__(self, cfg: LoRAConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LoRAConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.embed.requires_grad_(not cfg.freeze_embedding)
        self.blocks = nn.ModuleList(LoRABlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_config_for_params(target_params: int, n_layer: int = 4, block_size: int = 64, vocab_size: int = 1021) -> GPTConfig:
    """A GPTConfig with roughly ``target_params`` parameters (for benchmarks). n_embd is a multiple of n_head."""
    n_head = 4
    # params ~ 12 * n_layer * d^2 + vocab * d
    d = int((-vocab_size + math.sqrt(vocab_size ** 2 + 48 * n_layer * target_params)) / (24 * n_layer))
    d = max(n_head, d - d % n_head)
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=d)
