"""The tracer (benchmarks/hook_trace.py): it runs the four scenarios through the implementation ``adapters``
selects and shows, per unit, its functions beside the all-gathers and reduce-scatters.

Not graded: these tests check the tool. On an implementation that is not finished yet the trace stops at the
first NotImplementedError; the test is then skipped with the tool's own message (it names the task).
"""

from __future__ import annotations

import pytest

from benchmarks import hook_trace

# The collectives a step of each scenario issues per unit, in order, with one FlatParameter per kind of
# parameter: forward gathers each unit, backward gathers it again (resharded after forward) and reduce-scatters
# its gradient once, after its last gather of backward (the unit run twice too: its gradient is the sum).
UNITS = {"lora": ["blocks.0", "blocks.1", "<root>"], "reentrant": ["blocks.0", "blocks.1", "<root>"],
         "twice": ["block", "<root>"], "meta": ["blocks.0", "blocks.1", "<root>"]}


def _collectives_of(events, unit, phase):
    return [e["name"] for e in events if e["kind"] == "collective" and e["unit"] == unit and e["phase"] == phase]


def _check_plausible(scenario, results, strict=False):
    """Ranks agree, the task files' functions are traced, and per unit: an all-gather in forward, and in backward an
    all-gather before its (last) reduce-scatter. ``strict``: one reduce-scatter per unit, after its last gather of
    backward (what the staff's implementation does; another correct design may reduce-scatter a unit run twice per
    use)."""
    for r in results:
        assert r["end"] == "ok", f"{scenario}, rank {r['rank']}: {r.get('error')}"
        assert [(e["name"], e["numel"]) for e in r["events"] if e["kind"] == "collective"] == \
            [(e["name"], e["numel"]) for e in results[0]["events"] if e["kind"] == "collective"], \
            f"{scenario}: rank {r['rank']} issued other collectives than rank 0"
    events = results[0]["events"]
    calls = [e["name"] for e in events if e["kind"] == "call"]
    assert "task7_fully_shard.fully_shard" in calls, f"{scenario}: fully_shard is not in the trace: {calls[:10]}"
    assert any(c.startswith("task2_flat_param.") for c in calls), f"{scenario}: no Task 2 function traced"
    for unit in UNITS[scenario]:
        forward = _collectives_of(events, unit, "step 1 forward")
        backward = _collectives_of(events, unit, "step 1 backward")
        assert "ALL-GATHER" in forward, f"{scenario}: unit {unit} has no all-gather in forward: {forward}"
        assert "REDUCE-SCATTER" in backward and "ALL-GATHER" in backward, \
            f"{scenario}: unit {unit}'s backward: {backward} (expected its all-gather, then its reduce-scatter)"
        last_rs = max(i for i, x in enumerate(backward) if x == "REDUCE-SCATTER")
        assert last_rs > backward.index("ALL-GATHER"), \
            f"{scenario}: unit {unit}'s reduce-scatter comes before its all-gather of backward: {backward}"
        if strict:
            assert backward.count("REDUCE-SCATTER") == 1 and \
                backward.index("REDUCE-SCATTER") > max(i for i, x in enumerate(backward) if x == "ALL-GATHER"), \
                f"{scenario}: unit {unit}: not one reduce-scatter after its last all-gather of backward: {backward}"
    if scenario == "meta":
        materialize = [e for e in events if e["kind"] == "call" and e["phase"] == "materialize"]
        assert materialize and materialize[0]["name"] == "task1_meta_init.materialize_meta_module", materialize[:3]
    text = "\n".join(hook_trace.report(scenario, results))
    assert "== step 1: backward (loss.backward()) ==" in text and ">> REDUCE-SCATTER" in text, text[:2000]
    for unit in UNITS[scenario]:
        assert f"  {unit}:\n    shard:" in text, f"{scenario}: no per-unit section for {unit}:\n{text[-2000:]}"


@pytest.fixture(scope="module")
def traced():
    """The four scenarios on the implementation adapters selects (one run of two ranks, a few seconds)."""
    return hook_trace.trace(hook_trace.SCENARIOS)


def test_trace_shows_each_units_gathers_and_reduce_scatters_in_order(traced):
    found = traced
    for scenario, results in found.items():
        stopped = [r for r in results if r["end"] == "not implemented"]
        if stopped:
            pytest.skip("\n".join(hook_trace.report(scenario, results)[-2:]))
        _check_plausible(scenario, results)
    assert set(found) == set(hook_trace.SCENARIOS), f"scenarios missing from the trace: {set(found)}"


def test_ranks_that_differ_are_shown_side_by_side():
    """No ranks needed: two ranks whose collectives differ are both printed, and flagged."""
    def ev(i, name, unit="blocks.0"):
        return {"i": i, "kind": "collective", "name": name, "unit": unit, "numel": 8, "dtype": "float32",
                "async_op": False, "depth": 1, "phase": "step 1 backward", "caller": ""}
    a = {"rank": 0, "end": "ok", "impl": "x", "events": [ev(0, "ALL-GATHER"), ev(1, "REDUCE-SCATTER")]}
    b = {"rank": 1, "end": "ok", "impl": "x", "events": [ev(0, "ALL-GATHER")]}
    text = "\n".join(hook_trace.report("lora", [a, b]))
    assert "rank 1 (DIFFERS from rank 0" in text, text
    assert "step 1 backward: ALL-GATHER -> REDUCE-SCATTER" in text, text


# staff-only-begin
def test_trace_of_the_staff_implementation_is_exact(traced):
    """The staff's implementation (the default here): one reduce-scatter per unit, after its last gather."""
    for scenario, results in traced.items():
        _check_plausible(scenario, results, strict=True)


def test_trace_on_the_stubs_names_the_task_not_implemented(monkeypatch):
    """On the stubs (FSDP_IMPL=student in the staff repository) the trace stops at fully_shard: the report names
    Task 7, the file and the function, and the tool's exit status says so (2)."""
    monkeypatch.setenv("FSDP_IMPL", "student")
    found = hook_trace.trace(hook_trace.SCENARIOS)
    assert list(found) == ["lora"], f"the scenarios after the first stop should not run: {list(found)}"
    results = found["lora"]
    assert all(r["end"] == "not implemented" for r in results), results
    text = "\n".join(hook_trace.report("lora", results))
    assert "NOT IMPLEMENTED YET (rank 0): Task 7 raised NotImplementedError in fully_shard() " \
           "(fsdp_assignment/task7_fully_shard.py:" in text, text
    assert hook_trace.status(results) == 2


def test_trace_wraps_private_helpers_found_at_run_time(traced):
    """Every function of the task files is wrapped, private helpers too (found by looking, not from a list)."""
    results = traced["twice"]
    calls = {e["name"] for e in results[0]["events"] if e["kind"] == "call"}
    private = {c for c in calls if c.rpartition(".")[2].startswith("_") and not c.endswith("__init__")}
    assert private, f"no private helper of the task files in the trace: {sorted(calls)}"
# staff-only-end
