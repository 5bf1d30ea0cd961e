"""The benchmarks print the Models box's symbols (issue 31): N counts elements (b is bytes per element), K is HSDP's
shard group, S is the rank's parameter count only. Read from the staff run's own printed tables (no run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]


def test_the_comm_tables_use_the_models_box_symbols():
    comm = (ROOT / "staff" / "answer_key" / "results" / "comm.md").read_text(encoding="utf-8")
    assert not re.search(r"shard group: S=", comm), "the HSDP note calls the shard group S (S is the rank's parameter count)"
    assert "shard group: K=" in comm
    assert not re.search(r"N = the full tensor's bytes|\(W-1\)/W·N/beta", comm), "the fit's caption uses N in bytes"
    assert "N·b/beta" in comm and "N = the full tensor's elements" in comm
    source = (ROOT / "benchmarks" / "bench_comm.py").read_text(encoding="utf-8")
    assert not re.search(r"\bT = a \+ b N\b", source), "bench_comm's fit calls its slope b (b is bytes per element)"
