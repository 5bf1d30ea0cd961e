"""Task 1 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import adapters
from fsdp_assignment.support.models import ToyMLP


class TiedMiddle(nn.Module):
    """A tied weight whose later owner (``proj``) sits in the middle of the init order: the numbers its eager
    init consumed decide the values of every module after it."""

    def __init__(self, vocab: int = 17, dim: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab, bias=False)
        self.proj.weight = self.embed.weight
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 5)

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.embed(idx))))


class BufferOnly(nn.Module):
    """Owns a buffer and no parameter (a fixed table, a running statistic); its init draws random numbers, so
    its place in the init order matters too."""

    def __init__(self, dim: int = 7):
        super().__init__()
        self.register_buffer("table", torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.table.normal_()

    def forward(self, x):
        return x + self.table


class WithBufferOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.pos = BufferOnly(7)
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.pos(self.inp(x))))


class Typed(nn.Module):
    """Built in ``dtype`` (bf16, fp64) with an integer and a boolean buffer: its own parameter and buffers (not a
    FlatParameter's: this module is never sharded) next to torch layers' (BatchNorm's ``num_batches_tracked`` is
    int64). Materialized while the default dtype is fp32, each must come back in its own dtype."""

    def __init__(self, dtype: torch.dtype, dim: int = 6):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.register_buffer("steps", torch.empty((), dtype=torch.int32))
        self.register_buffer("mask", torch.empty(dim, dtype=torch.bool))
        self.reset_parameters()  # its own state before its children's: eager init runs in module pre-order
        self.lin = nn.Linear(dim, dim, dtype=dtype)
        self.norm = nn.BatchNorm1d(dim, dtype=dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.normal_()
            self.steps.fill_(3)
            self.mask.copy_(torch.arange(self.mask.numel()) % 2 == 0)

    def forward(self, x):
        return self.norm(self.lin(x * self.scale)) * self.mask


MODELS = {"nested_toy": lambda: ToyMLP(with_unused=True), "tied_middle": TiedMiddle, "buffer_only": WithBufferOnly,
          "typed_bf16": lambda: Typed(torch.bfloat16), "typed_fp64": lambda: Typed(torch.float64)}


def _materialize(rank, world_size, seed):
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = make()
        adapters.materialize_meta_module(model, "cpu")
        after = torch.rand(4)  # where the generator ended
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        out[name] = {"params": params, "after": after, "buffers": buffers,
                     "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
                     "dtypes": {k: str(v.dtype) for k, v in model.state_dict().items()},
                     "tied": name != "tied_middle" or model.proj.weight is model.embed.weight,
                     "meta_left": [n for n, t in model.state_dict().items() if t.is_meta]}
    return out


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


class HasNoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.odd = NoReset()


def _no_reset(rank, world_size):
    with torch.device("meta"):
        model = HasNoReset()
    try:
        adapters.materialize_meta_module(model, "cpu")
    except TypeError as e:
        return {"raised": "TypeError", "message": str(e)}
    return {"raised": None, "message": ""}


class PartlyReal(nn.Module):
    """A meta parameter next to a buffer that is already real (loaded, say) and a ``None`` buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(6))
        self.register_buffer("table", torch.zeros(5))
        self.register_buffer("missing", None)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.w)  # its own parameter only; the buffer's values come from elsewhere


def _partly_real(rank, world_size):
    with torch.device("meta"):
        model = PartlyReal()
    model._buffers["table"] = torch.arange(5.0)  # real already: materialization must leave it alone
    torch.manual_seed(3)
    adapters.materialize_meta_module(model, "cpu")
    return {"w": model.w.detach(), "table": model.table, "missing_is_none": model.missing is None}
