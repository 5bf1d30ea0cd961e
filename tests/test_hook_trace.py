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
    """The four scenarios on the implementation adapters selects (one run of two ranks, a few seconds), with the
    --show-rng and --show-state-dict-peaks checks."""
    return hook_trace.trace(hook_trace.SCENARIOS, show_rng=True, show_state_dict_peaks=True)


@pytest.fixture(scope="module")
def frozen_mixed():
    """lora with the frozen embedding, under mixed precision, with --show-dtypes (one more run of two ranks)."""
    return hook_trace.trace(("lora",), freeze_embedding=True, mixed_precision=True, show_dtypes=True)


def _stopped_or(results):
    """Skip with the tool's own message when the implementation is not finished."""
    if any(r["end"] == "not implemented" for r in results):
        pytest.skip("\n".join(hook_trace.report("lora", results)[-2:]))


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



def test_show_rng_tabulates_every_module_against_eager_init(traced):
    """--show-rng (meta): one row per parameter of the eager model, torch.equal each; the table and its summary."""
    results = traced["meta"]
    _stopped_or(results)
    probe = results[0]["probes"]["rng"]
    if probe["end"] == "not implemented":
        pytest.skip(probe["error"])
    assert probe["end"] == "ok", probe
    eager = hook_trace._eager_meta_model()
    assert [(r["module"], r["tensor"]) for r in probe["rows"] if r["kind"] == "parameter"] == \
        [((n.rpartition(".")[0] or "<root>"), n.rpartition(".")[2]) for n, _ in eager.named_parameters(remove_duplicate=False)]
    text = "\n".join(hook_trace.report("meta", results))
    assert "--show-rng (rank 0)" in text and "torch.equal" in text and "blocks.1.mlp.c_fc" in text, text[-3000:]
    assert f"of {len(probe['rows'])} tensors equal" in text and "rank 1:" in text.split("--show-rng")[1]
    assert "rng" not in (traced["lora"][0].get("probes") or {}), "--show-rng applies to the meta scenario only"


def test_rng_check_flags_the_module_that_drew_other_values(monkeypatch):
    """No ranks: the check itself, on a model that is eager init (seed 0) except one module drawn again: that
    module's tensors are not equal, every other one is."""
    import torch

    import adapters
    from benchmarks import hook_trace_probes as probes

    torch.manual_seed(0)
    model = hook_trace._eager_meta_model()
    model.blocks[1].mlp.c_fc.reset_parameters()  # draws other values than eager init did
    monkeypatch.setattr(adapters, "gather_full_params", lambda m: {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)})
    rows = probes.rng_check(model, hook_trace._eager_meta_model, 0)["rows"]
    assert {r["module"] for r in rows if not r["equal"]} == {"blocks.1.mlp.c_fc"}, rows
    text = "\n".join(probes._rng_lines([{"rank": 0, "probes": {"rng": {"end": "ok", "seed": 0, "rows": rows}}}]))
    assert "modules whose values differ from eager init: blocks.1.mlp.c_fc" in text, text


def test_show_state_dict_peaks_gives_each_ranks_full_and_sharded_peaks(traced):
    """--show-state-dict-peaks: per rank, the full and the sharded dicts' peaks (the four numbers the writeup
    asks for) and the model's size to read them against."""
    results = traced["meta"]
    _stopped_or(results)
    for r in results:
        probe = r["probes"]["peaks"]
        if probe["end"] == "not implemented":
            pytest.skip(probe["error"])
        assert probe["end"] == "ok", probe
        assert probe["full"]["peak"] >= probe["full"]["held"] >= 0 and probe["sharded"]["peak"] > 0, probe
    text = "\n".join(hook_trace.report("meta", results))
    psi = results[0]["sizes"]["psi"]
    assert f"Psi = {psi:,} parameters" in text, text[-2000:]
    rows = [line.split() for line in text.split("--show-state-dict-peaks:")[1].splitlines()
            if line.split()[:1] in (["0"], ["1"])]
    assert [(x[0], x[1]) for x in rows] == [("0", "full"), ("0", "sharded"), ("1", "full"), ("1", "sharded")], rows


def test_frozen_embedding_shows_in_the_per_unit_summary(traced, frozen_mixed):
    """Issue 41: the per-unit summary differed only in the full timeline. Now each FlatParameter says what is
    gathered and what is reduce-scattered: the frozen embedding's is gathered and never reduce-scattered."""
    plain, frozen = traced["lora"], frozen_mixed["lora"]
    _stopped_or(plain)
    _stopped_or(frozen)

    def root_summary(results):
        text = "\n".join(hook_trace.report("lora", results))
        return text.split("\n  <root>:\n")[1].split("\n\n")[0]

    assert "frozen" not in root_summary(plain), root_summary(plain)
    frozen_root = root_summary(frozen)
    line = next((x for x in frozen_root.splitlines() if "(frozen," in x), None)
    assert line and "ALL-GATHER 2 x" in line and "REDUCE-SCATTER never" in line, frozen_root


def test_show_dtypes_tabulates_each_unit(frozen_mixed):
    """--show-dtypes under --mixed-precision: a row per unit; the input a block's forward sees is bfloat16 (the
    policy casts floating inputs) and the reduce-scatter is float32 (reduce_dtype)."""
    results = frozen_mixed["lora"]
    _stopped_or(results)
    text = "\n".join(hook_trace.report("lora", results))
    table = text.split("--show-dtypes (rank 0, mixed precision)")[1].splitlines()[1:]
    rows = {x.split()[0]: x.split() for x in table if x.strip()}
    assert set(UNITS["lora"]) <= set(rows), table
    header = table[0].split("  ")
    assert rows["blocks.0"][3] == "bfloat16" and rows["blocks.0"][5] == "float32", (header, rows["blocks.0"])



def test_json_keeps_stdout_json_and_sends_the_ranks_output_to_stderr(monkeypatch, capsys):
    """No ranks (trace is replaced): what the ranks wrote goes to stderr under --json, labelled, and stdout is the
    JSON alone; in text mode it is printed first on stdout, under its heading."""
    import json

    def fake_trace(scenarios, *args, rank_output=None, **options):
        rank_output.append("[rank 1] hello from rank 1\n")
        return {"twice": [{"rank": r, "end": "ok", "impl": "x", "events": []} for r in (0, 1)]}

    monkeypatch.setattr(hook_trace, "trace", fake_trace)
    assert hook_trace.main(["--scenario", "twice", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["twice"][1]["rank"] == 1 and "[rank 1] hello from rank 1" in err, (out, err)
    assert hook_trace.main(["--scenario", "twice"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(hook_trace.RANK_OUTPUT_HEAD + "\n[rank 1] hello from rank 1\n"), out[:500]


# staff-only-begin
def test_staff_dtypes_and_state_dict_peaks_are_exact(traced, frozen_mixed):
    """The staff implementation: bf16 gathered, in forward and in autograd, fp32 reduced and held; rank 0's full
    dicts hold the whole model and its AdamW state (12 Psi bytes, plus the step counters), rank 1 keeps nothing,
    and a sharded pair holds 12 Psi / W."""
    seen = frozen_mixed["lora"][0]["probes"]["dtypes"]["units"]["blocks.0"]
    assert seen == {"params": ["bfloat16"], "input": ["bfloat16"], "grads": ["bfloat16"],
                    "shard_grad": ["float32"]}, seen
    results = traced["meta"]
    psi = results[0]["sizes"]["psi"]
    r0, r1 = (r["probes"]["peaks"] for r in results)
    assert 12 * psi <= r0["full"]["held"] <= 12 * psi + 1024, r0
    assert r1["full"]["held"] == 0 and r1["full"]["peak"] > 0, r1
    for p in (r0, r1):
        assert 12 * psi // 2 <= p["sharded"]["held"] <= 12 * psi // 2 + 1024, p


RANK_PROBE = "HOOK-TRACE-PROBE"


def test_a_print_in_a_task_file_shows_in_hook_trace_output(tmp_path):
    """Issue 41: a print added to the implementation's unshard (in a copy of the tree, never this one's files, and
    without flush=True) shows in hook_trace.py's output labelled by rank, for both ranks, and in rank 0's timeline
    where it happened. One run of the tool (about 10 s quiet, 25 s at load 17)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in ("fsdp_assignment", "tests", "benchmarks"):
        shutil.copytree(root / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "staff", "hidden",
                                                                                  "results"))
    for name in ("adapters.py", "pyproject.toml"):
        shutil.copy2(root / name, tmp_path / name)
    path = tmp_path / "fsdp_assignment" / "reference" / "task3_forward.py"
    text = path.read_text()
    anchor = "def unshard("
    body = text.index('"""', text.index('"""', text.index(anchor)) + 3) + 3  # after unshard's docstring
    path.write_text(text[:body] + f"\n    print('{RANK_PROBE}', dist.get_rank())" + text[body:])  # no flush
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FSDP_"))}
    run = [sys.executable, "benchmarks/hook_trace.py", "--scenario", "twice"]
    proc = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] {RANK_PROBE} {rank}" in proc.stdout, proc.stdout[:3000]
    timeline = proc.stdout.split("rank 0:\n")[1].split("\nper unit")[0]
    assert f"    [rank 0] {RANK_PROBE} 0" in timeline, timeline  # indented under the call that printed it
    assert f"[rank 1] {RANK_PROBE} 1" not in timeline  # rank 1's own events are rank 1's (same calls as rank 0)


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
