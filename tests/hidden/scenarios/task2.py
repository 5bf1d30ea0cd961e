"""Task 2 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import adapters
from fsdp_assignment.support.models import TiedModel, ToyMLP
from tests.hidden.scenarios.task1 import TiedMiddle, WithBufferOnly  # Task 1's init-order models, sharded here
from tests.public.common import describe_flat_params, hand_shard


WORLD_SIZES = (1, 2, 3, 4, 5)


def _linear_8():  # 3 * 2 + 2 = 8 elements: W = 1, 2, 4 divide it, 3 and 5 do not
    torch.manual_seed(3)
    return nn.Linear(3, 2)


def _scalar():  # 1 element: for W > 1 every rank but the first holds only padding
    torch.manual_seed(4)
    return nn.Linear(1, 1, bias=False)


def _tied():  # 23 * 11 + 2 * (11 * 11 + 11) = 517 elements, the tied weight stored once, across shards
    torch.manual_seed(5)
    return TiedModel()


MODULES = {"linear_8": _linear_8, "scalar": _scalar, "tied": _tied}


def _layouts(rank, world_size):
    out = []
    for name, make in MODULES.items():
        for w in WORLD_SIZES:
            for r in range(w):
                module = make()
                names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
                fp = adapters.make_flat_param(module, names, r, w)
                out.append({"module": name, "W": w, "r": r, "numel": int(fp.numel),
                            "padded_numel": int(fp.padded_numel), "shard_numel": int(fp.shard_numel),
                            "shard_offset": int(fp.shard_offset), "shard": fp.shard.detach().clone(),
                            "param_names": list(fp.param_names),
                            "ranges": {n: [int(x) for x in fp.shard_range(n)] for n in names}})
    # A rank outside [0, W) is refused, not wrapped around (Python's -1 would index the last shard).
    for r in (-1, 2):
        module = next(iter(MODULES.values()))()
        try:
            adapters.make_flat_param(module, [n for n, _ in module.named_parameters()], r, 2)
            out.append({"module": "<rank outside [0, W)>", "r": r, "error": None})
        except ValueError as e:
            out.append({"module": "<rank outside [0, W)>", "r": r, "error": str(e)})
    return out


def _nested_toy_units(model):
    return [m for b in model.blocks for m in (b.inner, b)] + [model]


MODELS = {
    # inside-out: each block's inner Sequential is a unit, then the block, then the root
    "nested_toy": (lambda: ToyMLP(with_unused=True), _nested_toy_units),
    "tied_middle": (TiedMiddle, lambda m: [m.mix, m]),
    "buffer_only": (WithBufferOnly, lambda m: [m.out, m]),  # the root unit holds a module with only a buffer
}


def _materialize(rank, world_size, seed):
    out = {}
    for name, (make, units) in MODELS.items():
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = make()
        hand_shard(model, units(model), hooks=None)  # FlatParameters only
        adapters.materialize_meta_module(model, "cpu")
        after = torch.rand(4)  # where the generator ended
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        out[name] = {"flat": describe_flat_params(model), "after": after, "buffers": buffers,
                     "meta_left": [n for n, t in model.state_dict().items() if t.is_meta]}
    return out
