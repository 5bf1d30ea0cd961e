"""Task 1: meta-device init (materialize_meta_module) of unsharded models: eager-identical values and RNG state,
and each parameter's and buffer's own dtype (a model built on meta in fp64 stays fp64).

Materializing *sharded* units needs Task 2's FlatParameter: those tests are Task 2's
(tests/public/test_task2_flat_param.py, ``test_sharded_meta_init_...``)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, TiedModel, ToyMLP
from tests.harness import run_ranks

pytestmark = pytest.mark.task1

MODELS = {"toy_mlp": lambda: ToyMLP(with_unused=True), "tied": TiedModel, "gpt": GPT}


def _materialize_unsharded(rank, world_size, model_name, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = MODELS[model_name]()
    adapters.materialize_meta_module(model, "cpu")
    after = torch.rand(4)  # the generator must end where eager init left it
    tied = model_name == "gpt" and model.lm_head.weight is model.wte.weight
    with torch.device("meta"):
        wide = MODELS[model_name]().to(torch.float64)  # built on meta in fp64; the default dtype stays fp32
    adapters.materialize_meta_module(wide, "cpu")
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "after": after, "tied": tied,
            "fp64_dtypes": {k: str(v.dtype) for k, v in wide.state_dict().items()},
            "meta_left": [n for n, t in model.state_dict().items() if t.is_meta],
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "is_param": {n: isinstance(p, torch.nn.Parameter) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_unsharded_module_matches_eager_init_bitwise(model_name):
    (got,) = run_ranks(_materialize_unsharded, 1, model_name, 1234)
    torch.manual_seed(1234)
    eager = MODELS[model_name]()
    after = torch.rand(4)
    assert not got["meta_left"], f"still on meta after materialize_meta_module: {got['meta_left']}"
    expected = eager.state_dict()
    assert got["state"].keys() == expected.keys(), (
        f"the state dict's names differ from eager init's: {sorted(got['state'].keys() ^ expected.keys())}: "
        f"materialize every parameter and buffer in place, under its own name")
    for name, tensor in expected.items():
        assert torch.equal(got["state"][name], tensor), \
            f"{name} differs from eager init under the same seed (the RNG must be consumed in eager order)"
    assert torch.equal(got["after"], after), "the random generator ends in a different state than after eager init"
    # Not only values: a frozen parameter (ToyMLP's `gate`) must stay frozen, every parameter a Parameter.
    expected_rg = {n: p.requires_grad for n, p in eager.named_parameters()}
    assert got["requires_grad"] == expected_rg, (
        f"requires_grad after materialize_meta_module differs from eager init: "
        f"{ {n: v for n, v in got['requires_grad'].items() if expected_rg.get(n) != v} } "
        f"(a frozen parameter must stay frozen)")
    assert all(got["is_param"].values()), "materialized parameters must still be nn.Parameter objects"
    if model_name == "gpt":
        assert got["tied"], "lm_head.weight and wte.weight must stay one tied parameter"
    # Not only fp32: a model built on meta in fp64 comes back fp64 (each tensor in its own dtype, not the default).
    expected_dtypes = {k: str(v.dtype) for k, v in eager.to(torch.float64).state_dict().items()}
    wrong = {k: v for k, v in got["fp64_dtypes"].items() if expected_dtypes.get(k) != v}
    assert got["fp64_dtypes"] == expected_dtypes, (
        f"a model built on meta in fp64 comes back with other dtypes: {wrong}: give every parameter and buffer "
        f"storage in its own dtype (a bf16 or fp64 model stays bf16 or fp64; integer and boolean buffers stay so)")


# ---- State already off meta keeps its values; a None buffer stays None ---------------------------------------------
def _partly_materialized(rank, world_size):
    torch.manual_seed(7)
    with torch.device("meta"):
        model = ToyMLP()
    block = model.blocks[1]  # all its own state made real before materializing: a gate and a buffer
    block.gate = torch.nn.Parameter(torch.full((block.gate.numel(),), 3.0), requires_grad=False)
    block.scale = torch.full((block.scale.numel(),), 7.0)
    model.blocks[2].register_buffer("absent", None)
    adapters.materialize_meta_module(model, "cpu")
    return {"gate": block.gate.detach().clone(), "scale": block.scale.clone(), "absent": model.blocks[2].absent,
            "meta_left": [n for n, t in model.state_dict().items() if t is not None and t.is_meta]}


def test_state_already_off_meta_keeps_its_values():
    (got,) = run_ranks(_partly_materialized, 1)
    assert not got["meta_left"], f"still on meta after materialize_meta_module: {got['meta_left']}"
    for name, value in (("gate", 3.0), ("scale", 7.0)):
        assert torch.equal(got[name], torch.full_like(got[name], value)), (
            f"blocks.1.{name} was a real tensor (all {value}) before materialize_meta_module and became "
            f"{got[name].tolist()[:4]}...: parameters and buffers already off meta keep their values (the docstring)")
    assert got["absent"] is None, "a None buffer (blocks.2.absent) must stay None"


# ---- A module with meta state and no reset_parameters() is refused ----------------------------------------------
class _NoInit(torch.nn.Module):
    """Owns a parameter but cannot re-initialize it: nothing could replay its init."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3))


def _without_reset_parameters(rank, world_size):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), _NoInit())
    try:
        adapters.materialize_meta_module(model, "cpu")
    except TypeError as e:
        return {"error": str(e)}
    return {"error": None}


def test_module_with_meta_state_and_no_reset_parameters_is_refused():
    (got,) = run_ranks(_without_reset_parameters, 1)
    assert got["error"] is not None, (
        "materialize_meta_module on a model with a module (_NoInit) that owns a meta parameter but defines no "
        "reset_parameters() must raise TypeError (the docstring): there is no init to replay")
    assert any(name in got["error"] for name in ("_NoInit", "'1'", '"1"')), (
        f"the TypeError must name the module (its class, _NoInit, or its name, '1'): {got['error']!r}")


# ---- A module that owns only buffers is initialized too ----------------------------------------------------------
class _RandomBuffer(torch.nn.Module):
    """Owns a buffer and no parameter; its init draws random numbers (the model contract: reset_parameters())."""

    def __init__(self):
        super().__init__()
        self.register_buffer("noise", torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        self.noise.normal_()


def _buffers_only():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), _RandomBuffer(), torch.nn.Linear(4, 2))


def _materialize_buffers_only(rank, world_size):
    torch.manual_seed(11)
    with torch.device("meta"):
        model = _buffers_only()
    adapters.materialize_meta_module(model, "cpu")
    return {"state": {k: None if v.is_meta else v.clone() for k, v in model.state_dict().items()},
            "after": torch.rand(2)}


def test_a_module_owning_only_buffers_is_initialized_too():
    (got,) = run_ranks(_materialize_buffers_only, 1)
    torch.manual_seed(11)
    eager = _buffers_only()
    after = torch.rand(2)
    for name, tensor in eager.state_dict().items():
        assert got["state"].get(name) is not None and torch.equal(got["state"][name], tensor), (
            f"{name} differs from eager init under the same seed (or stayed on meta); '1' owns only a buffer whose "
            f"init draws random numbers: a module that owns meta buffers and no parameter is initialized too, in its "
            f"place in the order")
    assert torch.equal(got["after"], after), "the random generator ends in a different state than after eager init"
