"""Task 1 (hidden): what machine-generated mutants (staff/autograder/machine_mutants.py) showed no test checked:
state already off ``meta`` keeps its values and a ``None`` buffer stays ``None`` (materialize_meta_module's
docstring)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adapters
from tests.harness import run_ranks

pytestmark = pytest.mark.task1


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


def test_state_already_off_meta_is_kept():
    got = run_ranks(_partly_real, 1)[0]
    torch.manual_seed(3)
    eager = PartlyReal()
    assert got["missing_is_none"], "a None buffer must stay None"
    assert torch.equal(got["table"], torch.arange(5.0)), \
        f"a buffer that was not on meta must keep its values; it became {got['table'].tolist()}"
    assert torch.equal(got["w"], eager.w.detach()), "the meta parameter must get its eager init values"
