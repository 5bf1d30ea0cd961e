"""Smoke tests for the benchmarks and the CPU memory tracker they use (fast: run them often).

The benchmark tests run each script end to end at a tiny size with W=2 (gloo, local spawn) and check that the
raw JSON, the markdown table and the PNG plot were written. They say nothing about the numbers themselves:
those depend on the machine. The tracker tests check exact byte counts on hand-made allocations.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fsdp_assignment.support.memory import LiveStorageTracker


# ---- LiveStorageTracker ---------------------------------------------------------------------------------
def test_tracker_counts_allocations_and_frees():
    with LiveStorageTracker() as mem:
        a = torch.zeros(1000)                       # 4000 bytes
        b = a.view(10, 100)                         # a view: same storage, counted once
        assert mem.current_bytes == 4000
        c = torch.ones(500, dtype=torch.float64)    # 4000 bytes
        assert mem.current_bytes == 8000
        del a
        assert mem.current_bytes == 8000            # b still holds the storage
        del b
        gc.collect()
        assert mem.current_bytes == 4000
        assert mem.peak_bytes == 8000
        del c
        assert mem.current_bytes == 0
        mem.reset_peak()
        assert mem.peak_bytes == 0


def test_tracker_follows_storage_resize():
    # FSDP frees an unsharded buffer by resizing its storage to 0 and re-allocates it by resizing it back.
    with LiveStorageTracker(resize_label="unsharded") as mem:
        t = torch.empty(256)                        # 1024 bytes
        t.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        t.untyped_storage().resize_(4096)
        assert mem.current_bytes == 4096
        assert mem.bytes_by_label() == {"unsharded": 4096}
        u = torch.empty(0)
        u.resize_(100)                              # aten.resize_ goes through the dispatcher
        assert mem.current_bytes == 4096 + 400
        assert mem.peak_bytes == 4096 + 400
    # untracked storages created before the tracker are counted once a resize touches them
    old = torch.empty(10)
    orig_resize = torch.UntypedStorage.resize_
    with LiveStorageTracker() as mem:
        old.untyped_storage().resize_(0)
        old.untyped_storage().resize_(80)
        assert mem.current_bytes == 80
    assert torch.UntypedStorage.resize_ is orig_resize  # the wrapper is gone after the tracker exits


def test_tracker_labels_and_peak_breakdown():
    w = torch.randn(100, 100, requires_grad=True)   # exists before: counted only through track()
    with LiveStorageTracker() as mem:
        assert mem.track(w, label="params") == 40000
        mem.reset_peak()
        with mem.label("activations"):
            h = w @ w                               # 40000
            big = torch.empty(50_000)               # 200000: the peak
            del big
            h.sum().backward()
        # the gradient was allocated under "activations"; relabelling it changes the peak breakdown too
        mem.relabel(w.grad, "grads")
        assert mem.peak_bytes >= 40000 + 40000 + 200000
        breakdown = mem.peak_breakdown()
        assert breakdown["params"] == 40000
        assert breakdown["activations"] >= 240000
        assert sum(breakdown.values()) == mem.peak_bytes
        assert mem.bytes_by_label()["grads"] == 40000


# ---- the benchmarks, end to end at a tiny size ----------------------------------------------------------
# The exact table headers: the writeup template copies them, so a change here is a change there too.
HEADERS = {
    "memory": ["| strategy | W | peak MiB | model MiB | model error | vs one process | params MiB | grads MiB | optim MiB "
               "| unsharded MiB | activations MiB |"],
    "comm": ["| collective | W | interconnect | size | time us | algbw GB/s | busbw GB/s |",
             "| strategy | W | all-gather MiB | reduce-scatter MiB | all-reduce MiB | total MiB | formula | formula MiB "
             "| counted / formula | note |"],
    "step": ["| strategy | W | interconnect | step ms | vs one process | exposed comm | tokens/s |",
             "| comparison | W | interconnect | ratio (median) | min | max | rounds |"],
    "scaling": ["| scaling | strategy | W | global batch | batch per rank | step ms | efficiency | tokens/s "
                "| peak MiB per rank |"],
}


# slow: about a minute quiet, 144-225 s at load 8 (issue 8): CI runs it, `-m "not slow"` leaves it out. Its time
# limit is generous (each benchmark launch has its own 600 s timeout): a loaded machine must not fail it.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_run_all_quick_writes_tables_json_and_plots(tmp_path):
    """All four benchmarks at a tiny size (W=2, gloo, local launcher, simulated link on in the step benchmark):
    each writes its JSON, its markdown table with the documented headers, and a PNG. With the student's
    unfinished tasks the FSDP rows are listed as not measured and everything else still runs."""
    import json

    import pytest

    pytest.importorskip("matplotlib", reason="the benchmarks' plots need matplotlib: pip install -e .[bench]")
    from benchmarks import run_all

    run_all.main(["--quick", "--out", str(tmp_path), "--quiet"])
    for name, headers in HEADERS.items():
        md = (tmp_path / f"{name}.md").read_text()
        for header in headers:
            assert header in md, f"{name}.md lost its header {header!r}:\n{md}"
        raw = json.loads((tmp_path / f"{name}.json").read_text())
        assert raw["benchmark"] == name and raw["environment"]["torch"]
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # the documented headers are the ones in each script's docstring
        module = getattr(run_all, f"bench_{name}")
        for header in headers:
            assert header in module.__doc__
        assert md.startswith("**quick run"), f"{name}.md does not say it is a quick run"
        assert raw["quick"] is True
    step = (tmp_path / "step.md").read_text()
    assert "Simulated interconnect" in step and "simulated" in step  # the output says when the link is simulated
    assert "quick run" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpt2_and_train_quick_runs(tmp_path):
    """gpt2_small.py and train_gpt.py at their --quick sizes (W=2, local launcher): the GPT-2 run writes a row per
    checkpointing setting with a measured peak and its model; the training run equals one process (1e-5)."""
    from benchmarks import gpt2_small, train_gpt

    raw = gpt2_small.main(["--quick", "--out", str(tmp_path), "--quiet"])
    md = (tmp_path / "gpt2.md").read_text()
    assert md.startswith("**quick run") and "| W | activation checkpointing | peak MiB | model MiB |" in md
    assert [r["checkpointing"] for r in raw["results"]] == [False, True]
    for r in raw["results"]:
        assert r["peak_bytes"] > 0 and r["model"]["peak_bytes"] > 0
        # materializing unit by unit never holds the whole model's full parameters on one rank
        assert max(x["init_peak_bytes"] for x in r["per_rank"]) < 4 * raw["psi"]
    raw = train_gpt.main(["--quick", "--out", str(tmp_path), "--quiet"])
    r0 = raw["results"][0]["ranks"][0]
    assert r0["max_rel_err"] <= 1e-5, (r0["worst_param"], r0["max_rel_err"])
