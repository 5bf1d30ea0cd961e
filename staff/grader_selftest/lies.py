"""Submissions that lie, each next to its honest twin (issue 25), graded in full by the real grading command.

    python -m staff.grader_selftest.lies            # grade the four submissions; exit 1 if a lie outscores its twin
    python -m staff.grader_selftest.lies --only never_free

A rank runs the student's code, which can rewrite anything in its own process: the storage sizes the tests read,
the collective counters, the monitor. Each bug below is the reference with one honest defect; its lie adds the few
lines that make the ranks' own reports say the defect is not there:

- never_free: ``free_unsharded`` keeps the storage (FSDP's memory saving gone). The lie makes every storage it
  "freed" read 0 bytes through ``UntypedStorage.size``/``nbytes``.
- all_reduce: gradients are all-reduced, each rank keeping its chunk (twice a reduce-scatter's bytes). The lie
  relabels the all-reduce as a reduce-scatter in the tests' collective counter.
- never_free_unwatched (issue 32): never_free's bug and lie, and the rank raises in the run the kernel watches
  (it finds the harness's ``config["witnessed"]`` on its stack), so no witness ever reads its memory. It scored
  99.56 before the grader failed closed (grading_plugin.Grader.fail_closed).

The kernel's witness (tests/harness.py, Witness) sees through both in the one test it runs in; the grading plugin
then judges every graded test that decides the same property from what the ranks report by the kernel's count
(grading_results.py, "refuted"): a lie must score no more than its honest twin. tests/staff/test_lies.py checks it
on the tests that decide it; this command grades all of them (about 2 minutes a submission, quiet).
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


def files(lie: Lie, lying: bool, root: Path = ROOT) -> dict[str, str]:
    """The seven task files of the submission: the reference's, with the bug (and the lie when ``lying``)."""
    out = mutant_grading.reference_student_files(root)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="lie ids (default: all)")
    p.add_argument("--write", action="store_true",
                   help=f"record the scores and failed tests in {RECORD.relative_to(ROOT)} (tests/staff/test_lies.py "
                        f"checks that every test an honest twin fails is one the kernel's verdict reaches)")
    args = p.parse_args(argv)
    bad = 0
    record = json.loads(RECORD.read_text()) if args.write and args.only is not None and RECORD.exists() else {}
    with tempfile.TemporaryDirectory(prefix="fsdp-lies-") as d:
        for lie in LIES:
            if args.only is not None and lie.id not in args.only:
                continue
            entry = {"what": lie.what}
            for lying in (False, True):
                data = grade(lie, lying, Path(d))
                key = "lying" if lying else "honest"
                entry[f"{key}_score"], entry[f"{key}_failed"] = required_score(data), failed_tests(data)
                entry[f"{key}_seconds"] = round(data["_seconds"])
                entry[f"{key}_refuted"] = [line for line in data.get("output", "").splitlines()
                                           if "kernel's witness refuted" in line]
                print(json.dumps({"lie": lie.id, key: entry[f"{key}_score"], "failed": len(entry[f"{key}_failed"]),
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
