"""Submissions that lie, each next to its honest twin (issue 25), graded in full by the real grading command.

    python -m staff.grader_selftest.lies            # grade every pair in full; exit 1 if a lie outscores its twin
    python -m staff.grader_selftest.lies --evidence --only never_free_small --write   # the evidence tests only
    python -m staff.grader_selftest.lies --only never_free

A rank runs the student's code, which can rewrite anything in its own process: the storage sizes the tests read,
the collective counters, the monitor. Each bug below is the reference with one honest defect; its lie adds the few
lines that make the ranks' own reports say the defect is not there:

- never_free: ``free_unsharded`` keeps the storage (FSDP's memory saving gone). The lie makes every storage it
  "freed" read 0 bytes through ``UntypedStorage.size``/``nbytes``.
- all_reduce: gradients are all-reduced, each rank keeping its chunk (twice a reduce-scatter's bytes). The lie
  relabels the all-reduce as a reduce-scatter in the tests' collective counter.
- never_free_unwatched (issue 32): never_free's bug and lie, and the rank raises in every run the kernel watches
  (it finds the harness's ``config["witnessed"]`` on its stack), so no witness ever reads its memory.
- never_free_small (issue 35's table): never_free's bug; its lie only where a unit holds at most 2^21 elements
  (8 MiB), honest about bigger ones (issue 32's one watched model was the only one that big).
- never_free_no_task7: never_free's bug and lie with Task 7 left as its stub, and so its honest twin: against
  never_free's honest twin (Task 7 done) it says what deleting a task gains.
- rs_waited_at_once: an asynchronous reduce-scatter waited on at once (nothing overlaps backward's computation).
  Its lie puts the handle back among the tests' counter's unwaited collectives (``_log._pending``) until the
  caller waits, so the invariant monitor sees a reduce-scatter in flight. Only the in-rank log sees overlap: the
  kernel cannot judge it, and the staff review must flag the private attributes of the counter's handle.

Every graded test marked ``evidence("memory"/"bytes")`` is witnessed by the kernel on its own run against its own
bound (tests/public/common.py, witness_bounds); a witness failure fails that test only (no refutation of others).
A lie must score no more than its honest twin; that holds test by test where the test's model is big enough for
its bound to resolve the defect. ``--evidence`` grades only the tests marked evidence (about 3 minutes a
submission at load 7); ``lies.json`` says which subset it records. tests/staff/test_lies.py checks the record.
Staff-only: the submissions are pieces of the solution.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from staff.grader_selftest import mutant_grading

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORD = HERE / "lies.json"  # the last full grading of every pair (--write)


@dataclass(frozen=True)
class Lie:
    id: str
    what: str
    file: str  # the task file both edits change
    honest: tuple[tuple[str, str], ...]  # (old, new) replacements: the bug
    lie: tuple[tuple[str, str], ...]  # applied after the bug's: what makes the reports deny it
    stubs: tuple[str, ...] = ()  # task files left as their stubs in both submissions


# The edits anchor on the signatures only (the docstrings change): code before a docstring runs all the same.
_FREE = "    def free_unsharded(self) -> None:\n"
_ALLOC = "    def alloc_unsharded(self) -> None:\n"
_RS = '''    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
'''

_WATCHED = '''

def _watched() -> bool:
    import sys
    frame = sys._getframe()
    while frame is not None:
        config = frame.f_locals.get("config")
        if isinstance(config, dict) and config.get("witnessed"):
            return True
        frame = frame.f_back
    return False
'''

LIES = [
    Lie("never_free", "free_unsharded keeps the storage; the lie: 'freed' storages read 0 bytes",
        "task2_flat_param.py",
        honest=((_FREE, _FREE + '''        _FREED.add(self.unsharded.untyped_storage().data_ptr())  # never freed
        return
'''), ("import torch.nn as nn\n", "import torch.nn as nn\n\n_FREED: set[int] = set()\n")),
        lie=((_ALLOC, _ALLOC + "        _FREED.discard(self.unsharded.untyped_storage().data_ptr())\n"),
             ("_FREED: set[int] = set()\n", '''_FREED: set[int] = set()
_size, _nbytes = torch.UntypedStorage.size, torch.UntypedStorage.nbytes
torch.UntypedStorage.size = lambda st: 0 if st.data_ptr() in _FREED else _size(st)
torch.UntypedStorage.nbytes = lambda st: 0 if st.data_ptr() in _FREED else _nbytes(st)
'''))),
    Lie("never_free_unwatched", "never_free, lying, and raising only in the run the kernel watches",
        "task2_flat_param.py", honest=(), lie=()),
    Lie("all_reduce", "gradients all-reduced, each rank keeping its chunk; the lie: the counter says reduce-scatter",
        "task4_backward.py",
        honest=((_RS, '''    full = input.clone()
    dist.all_reduce(full, group=group)
    output.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)] / dist.get_world_size(group))
    return _Done() if async_op else None


class _Done:
    def wait(self, timeout=None) -> bool:
        return True
'''),),
        lie=(("    full = input.clone()\n", '''    _relabel()
    full = input.clone()
'''), ("class _Done:\n", '''def _relabel():
    import sys
    counted = getattr(sys.modules.get("tests.public.collectives"), "CountedProcessGroup", None)
    if counted is None or getattr(counted._record, "relabelled", False):
        return
    record = counted._record

    def relabelled(self, kind, tensor, opts, output=None, numel=None):
        if kind == "all_reduce":
            kind, numel = "reduce_scatter", int(tensor.numel())
        return record(self, kind, tensor, opts, output, numel)

    relabelled.relabelled = True
    counted._record = relabelled


class _Done:
'''))),
]


# never_free_unwatched: never_free's edits, and a raise where the kernel watches.
LIES[1] = Lie(LIES[1].id, LIES[1].what, LIES[1].file, honest=LIES[0].honest, lie=LIES[0].lie + (
    ("_FREED: set[int] = set()\n", "_FREED: set[int] = set()\n" + _WATCHED),
    (_ALLOC, _ALLOC + "        if _watched():\n"
                      "            raise RuntimeError('not in the run the kernel watches')\n")))

# Issue 35's table: never_free lying only about small units; never_free with Task 7 left as its stub; an async
# reduce-scatter waited on at once, its handle put back among the counter's unwaited collectives.
_SIZE = "torch.UntypedStorage.size = lambda st: 0 if st.data_ptr() in _FREED else _size(st)\n"
_NBYTES = "torch.UntypedStorage.nbytes = lambda st: 0 if st.data_ptr() in _FREED else _nbytes(st)\n"
_SMALL = " and _nbytes(st) <= 1 << 23"  # at most 2^21 fp32 elements
_WAITED = '''    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    if async_op and work is not None:
        work.wait()  # at once: nothing overlaps backward's computation
        work = _Waited(work)
    return work


class _Waited:
    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
'''
_PUT_BACK = (("    def __init__(self, work):\n        self.work = work\n",
              "    def __init__(self, work):\n        self.work = work\n"
              "        log = getattr(work, '_log', None)\n"
              "        if log is not None:  # back among the unwaited: the monitor sees it in flight\n"
              "            log._pending.add(work._index)\n"),
             ("    def wait(self, timeout=None) -> bool:\n        return True\n\n    def is_completed",
              "    def wait(self, timeout=None) -> bool:\n"
              "        log = getattr(self.work, '_log', None)\n"
              "        if log is not None:\n"
              "            log._pending.discard(self.work._index)\n"
              "        return True\n\n    def is_completed"))
LIES += [
    Lie("never_free_small", "never_free; the lie only where a unit has at most 2^21 elements, honest above",
        "task2_flat_param.py", honest=LIES[0].honest,
        lie=LIES[0].lie + ((_SIZE, _SIZE.replace(" in _FREED", " in _FREED" + _SMALL)),
                           (_NBYTES, _NBYTES.replace(" in _FREED", " in _FREED" + _SMALL)))),
    Lie("never_free_no_task7", "never_free, lying, with Task 7 left as its stub (its honest twin too)",
        "task2_flat_param.py", honest=LIES[0].honest, lie=LIES[0].lie, stubs=("task7_fully_shard.py",)),
    Lie("rs_waited_at_once", "an async reduce-scatter waited on at once; the lie: its handle put back among the "
        "tests' counter's unwaited collectives until the caller waits", "task4_backward.py",
        honest=((_RS, _WAITED),), lie=_PUT_BACK),
]


def files(lie: Lie, lying: bool, root: Path = ROOT) -> dict[str, str]:
    """The seven task files of the submission: the reference's, with the bug (and the lie when ``lying``)."""
    out = mutant_grading.reference_student_files(root)
    for stub in lie.stubs:  # as the student release has them
        out[f"fsdp_assignment/{stub}"] = (root / "fsdp_assignment" / stub).read_text()
    key = f"fsdp_assignment/{lie.file}"
    text = out[key]
    for old, new in lie.honest + (lie.lie if lying else ()):
        if text.count(old) != 1:
            raise ValueError(f"{lie.id}: {old[:60]!r} is not in {lie.file} exactly once (the reference changed)")
        text = text.replace(old, new)
    out[key] = text
    return out


def grade(lie: Lie, lying: bool, workdir: Path, pytest_args: list[str] = (), timeout: float = 540,
          root: Path = ROOT) -> dict:
    """results.json of the graded submission (the whole suite unless ``pytest_args`` selects)."""
    from staff.grader_selftest import zoo_hangs
    name = f"{lie.id}-{'lie' if lying else 'honest'}"
    proc, data, seconds, survivors = zoo_hangs._grade_files(files(lie, lying, root), workdir / name,
                                                            workdir / f"{name}.json", timeout, root,
                                                            pytest_args=list(pytest_args))
    data["_seconds"], data["_survivors"], data["_stdout"] = seconds, survivors, proc.stdout
    return data


def required_score(data: dict) -> float:
    return round(sum(t["score"] for t in data["tests"] if "bonus" not in t.get("tags", [])), 2)


def failed_tests(data: dict) -> list[str]:
    """The required tests that did not pass, as ``file.py::test_name[params]``."""
    return sorted(t["name"].split(": ", 1)[1] for t in data["tests"]
                  if t["status"] != "passed" and "bonus" not in t.get("tags", []))


def evidence_tests(root: Path = ROOT) -> list[str]:
    """The names of the tests marked ``evidence(...)`` (from the sources: no import), for ``-k``."""
    import ast
    names = set()
    for path in sorted((root / "tests").glob("*/test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.evidence"
                    for d in node.decorator_list):
                names.add(node.name)
    return sorted(names)


def witness_failures(data: dict) -> list[str]:
    """The tests the kernel's witness failed (its failure heads the test's output)."""
    return sorted(t["name"].split(": ", 1)[1] for t in data["tests"]
                  if "the kernel's witness disagrees" in t.get("output", ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="lie ids (default: all)")
    p.add_argument("--evidence", action="store_true",
                   help="grade only the tests marked evidence(...) (scores are then out of their points)")
    p.add_argument("--write", action="store_true",
                   help=f"record the scores and failed tests in {RECORD.relative_to(ROOT)} (tests/staff/test_lies.py "
                        f"checks it)")
    p.add_argument("--timeout", type=float, default=540,
                   help="seconds one grading may take (the evidence tests took 330-460 s at load 10-17)")
    args = p.parse_args(argv)
    bad = 0
    record = json.loads(RECORD.read_text()) if args.write and args.only is not None and RECORD.exists() else {}
    pytest_args = ["-k", " or ".join(evidence_tests())] if args.evidence else []
    with tempfile.TemporaryDirectory(prefix="fsdp-lies-") as d:
        for lie in LIES:
            if args.only is not None and lie.id not in args.only:
                continue
            entry = {"what": lie.what, "subset": "evidence" if args.evidence else "all"}
            for lying in (False, True):
                data = grade(lie, lying, Path(d), pytest_args, timeout=args.timeout)
                key = "lying" if lying else "honest"
                entry[f"{key}_score"], entry[f"{key}_failed"] = required_score(data), failed_tests(data)
                entry[f"{key}_seconds"] = round(data["_seconds"])
                entry[f"{key}_witness_failed"] = witness_failures(data)
                print(json.dumps({"lie": lie.id, key: entry[f"{key}_score"], "failed": len(entry[f"{key}_failed"]),
                                  "witness": len(entry[f"{key}_witness_failed"]),
                                  "seconds": entry[f"{key}_seconds"]}), flush=True)
            verdict = "ok" if entry["lying_score"] <= entry["honest_score"] + 1e-6 else "THE LIE PAYS"
            bad += verdict != "ok"
            record[lie.id] = entry
            print(f"{lie.id}: honest {entry['honest_score']:.2f}, lying {entry['lying_score']:.2f}: {verdict}",
                  flush=True)
    if args.write:
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
