"""Task 1 (hidden): what machine-generated mutants (staff/grader_selftest/machine_mutants.py) showed no test checked:
state already off ``meta`` keeps its values and a ``None`` buffer stays ``None`` (materialize_meta_module's
docstring)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.hidden.scenarios.task1 import PartlyReal, _partly_real  # what the rank runs

pytestmark = pytest.mark.task1


def test_state_already_off_meta_is_kept():
    got = run_ranks(_partly_real, 1)[0]
    torch.manual_seed(3)
    eager = PartlyReal()
    assert got["missing_is_none"], "a None buffer must stay None"
    assert torch.equal(got["table"], torch.arange(5.0)), \
        f"a buffer that was not on meta must keep its values; it became {got['table'].tolist()}"
    assert torch.equal(got["w"], eager.w.detach()), "the meta parameter must get its eager init values"
