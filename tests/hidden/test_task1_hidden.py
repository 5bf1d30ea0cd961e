"""Task 1 (hidden): meta-device init replays the RNG exactly (nested modules, a tied weight whose later owner
sits mid-order, buffers, a module that owns only a buffer) and keeps frozen parameters frozen and every
parameter's and buffer's dtype (modules built on meta in bf16 and fp64, integer and boolean buffers); a module
without reset_parameters() is refused. The sharded variant is Task 2's (tests/hidden/test_task2_hidden.py), as
it needs FlatParameters."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.hidden.scenarios.task1 import MODELS, _materialize, _no_reset  # noqa: F401 (what the ranks run)

pytestmark = pytest.mark.task1


@pytest.mark.weight(3)
def test_meta_init_replays_the_rng_exactly():
    seed = 4321
    (got_all,) = run_ranks(_materialize, 1, seed)
    for name, make in MODELS.items():
        torch.manual_seed(seed)
        eager = make()
        after = torch.rand(4)
        got = got_all[name]
        assert not got["meta_left"], f"{name}: still on meta after materialize: {got['meta_left']}"
        assert got["tied"], f"{name}: proj.weight and embed.weight must stay one tied parameter"
        expected_dtypes = {k: str(v.dtype) for k, v in eager.state_dict().items()}
        wrong = {k: (v, expected_dtypes.get(k)) for k, v in got["dtypes"].items() if expected_dtypes.get(k) != v}
        assert got["dtypes"] == expected_dtypes, (
            f"{name}: dtypes after materialize differ from the model's own (built on meta in them, the default "
            f"dtype fp32): {wrong} (got, expected). Give every parameter and buffer storage in its own dtype: a "
            f"bf16 or fp64 model stays bf16 or fp64, integer and boolean buffers stay integer and boolean")
        for pname, p in eager.named_parameters(remove_duplicate=False):
            assert torch.equal(got["params"][pname], p), (
                f"{name}: parameter {pname} differs from eager init under the same seed: values must equal eager "
                f"init's, every module and tied weights' later owners included (they consumed random numbers in "
                f"eager init too; Task 1's contract, hints/task1/01-replay-order)")
        assert set(got["buffers"]) == {k for k, _ in eager.named_buffers()}, f"{name}: buffers {sorted(got['buffers'])}"
        for k, v in eager.named_buffers():
            assert torch.equal(got["buffers"][k], v), f"{name}: buffer {k} differs from eager init"
        expected_rg = {n: p.requires_grad for n, p in eager.named_parameters()}
        assert got["requires_grad"] == expected_rg, f"{name}: requires_grad after materialize differs from eager init"
        assert torch.equal(got["after"], after), (
            f"{name}: the random generator ends in another state than after eager init: the replay consumed a "
            f"different amount of random numbers")


def test_module_without_reset_parameters_is_rejected():
    (got,) = run_ranks(_no_reset, 1)
    assert got["raised"] == "TypeError", \
        "a module that owns meta parameters but defines no reset_parameters() must raise TypeError"
    assert "NoReset" in got["message"] or "odd" in got["message"], \
        f"the TypeError must name the module (its class or its name); got {got['message']!r}"
