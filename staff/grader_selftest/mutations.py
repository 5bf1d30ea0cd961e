"""Mutation self-test: seeded single-point bugs of the reference that the public + hidden suite must catch.

    python -m staff.grader_selftest.mutations                 # every mutant, 2 workers; exit 1 below the kill rates
    python -m staff.grader_selftest.mutations --only m11 m15  # some of them
    python -m staff.grader_selftest.mutations --list          # what each one seeds

Each mutant is one edit (``old`` -> ``new``, ``old`` must occur exactly once) of one reference task file. For a
mutant, the seven reference task files are rewritten in the students' layout (``from ..support`` ->
``from .support``), the edit is applied, and they are installed as the student files of a fresh grading tree
(the bundle's tree, ``build_bundle.stage``) and graded by the grading command with ``-x`` (``run_mutant``: first
the hidden test written for this bug, if any; then the public tests alone, in a tree without the hidden ones;
then, if it survived them, the hidden tests). The mutant is killed when a test fails; the first failing test is
its killer.

The report gives two rates: the whole suite's (public + hidden: every mutant must be killed) and the **public
suite's own** (killed by at least one public test / all mutants graded; goal PUBLIC_KILL_RATE_GOAL), with the
mutants that only the hidden tests kill: bugs a student meets only in the grade (issue 37).

The list covers every bug named in the autograder issue (``issue_bug``) and more. ``target`` names the hidden
test meant to catch a bug that the public tests miss: that test runs first, so the report shows whether it
does its job. Every hidden test is the target of at least one mutant.

Mutants are staff-only (they contain pieces of the solution) and never go into the bundle or the release.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILL_RATE_REQUIRED = 1.0  # every mutant killed (issue 13)
PUBLIC_KILL_RATE_GOAL = 0.85  # killed by a public test (issue 37): the public tests meet the student where bugs are

from staff.grader_selftest import mutant_grading  # the grading path both mutation systems share
from staff.grader_selftest.mutant_grading import (TASK_FILES, reference_student_files, stage_tree,  # noqa: F401
                                                  student_form)


# The student bugs the autograder issue names: each must be seeded by at least one mutant, and killed.
ISSUE_BUGS = (
    "padding wrong when W does not divide numel",
    "gradients summed instead of averaged",
    "padding gradients not zeroed",
    "nested units' parameters counted twice",
    "tied weights updated twice, or once on the wrong rank",
    "a reshard that drops the reference but keeps the storage",
    "no re-gather in backward after reshard",
    "reduce-scatter not finished before step",
    "clip norm computed locally",
    "optimizer state replicated instead of sharded",
    "prefetch that waits on the wrong handle or keeps every unit unsharded",
    "meta init that consumes the RNG in another order",
    "mixed precision reducing in the wrong dtype",
    "gradient accumulation that syncs too early or drops a micro-batch",
)


from staff.grader_selftest.mutant_list import MUTANTS, Mutant  # noqa: E402  (the list itself)


# ---- what kind of bug each mutant seeds --------------------------------------------------------------------
# The report groups mutants per task and per kind, so that it says which kinds of bug the suite is shown to
# catch for each task (and which kinds no mutant probes yet). Every mutant has exactly one kind.
KINDS = {
    "layout": "padding, shard boundaries, flattening",
    "rng": "meta init's RNG replay",
    "state": "state beyond values: requires_grad, buffers, dtypes of buffers",
    "grad-math": "gradient arithmetic: mean vs sum, accumulation, clipping",
    "precision": "mixed precision: param/reduce dtype, input casts",
    "accumulation": "gradient accumulation without sync",
    "lifecycle": "unit life cycle: gather, reshard, hooks, several outputs",
    "async": "async correctness: handles not waited on, ordering",
    "waste": "wasted communication: needless, late or missing gathers, traffic every micro-batch",
    "memory": "memory: storage not freed, state replicated instead of sharded",
    "ownership": "ownership and tied weights",
    "checkpoint": "checkpoints: state dicts and resume",
    "contract": "errors and contracts: what must be refused",
    "hsdp": "bonus: HSDP groups, replication and the mesh",
    "offload": "bonus: CPU offload",
}
KIND_OF: dict[str, str] = {
    "m01": "rng", "m02": "rng", "m03": "ownership", "m04": "memory", "m05": "contract", "m06": "state",
    "m07": "layout", "m08": "layout", "m09": "layout", "m10": "ownership", "m11": "memory", "m12": "layout",
    "m13": "lifecycle", "m14": "lifecycle", "m15": "precision", "m16": "precision", "m17": "grad-math",
    "m18": "lifecycle", "m19": "layout", "m20": "async", "m21": "grad-math", "m22": "precision",
    "m23": "accumulation", "m24": "accumulation", "m25": "lifecycle", "m26": "grad-math", "m27": "grad-math",
    "m28": "memory", "m29": "checkpoint", "m30": "checkpoint", "m31": "checkpoint", "m32": "memory",
    "m33": "waste", "m34": "async", "m35": "ownership", "m36": "precision", "m37": "accumulation",
    "m38": "lifecycle", "m39": "ownership", "m40": "ownership", "m41": "waste", "m42": "state",
    "m43": "checkpoint", "m44": "memory",
    "g01": "state", "g02": "state", "g03": "state", "g04": "state", "g05": "precision", "g06": "async",
    "g07": "waste", "g08": "lifecycle", "g09": "waste", "g10": "precision", "g11": "waste", "g12": "checkpoint",
    "g13": "checkpoint", "g14": "memory", "g15": "memory", "g16": "waste", "g17": "waste", "g18": "waste",
    "g19": "memory", "g20": "async", "g21": "precision", "g22": "precision", "g23": "memory",
    # core's block (frozen units, activation checkpointing, units run twice)
    "c01": "lifecycle", "c02": "lifecycle", "c05": "lifecycle",
    "c07": "lifecycle", "c08": "rng", "c09": "memory", "c10": "async",
    # issue 21's bonus
    "b01": "hsdp", "b02": "hsdp", "b03": "hsdp", "b04": "hsdp", "b05": "hsdp", "b06": "hsdp", "b07": "hsdp",
    "b08": "hsdp", "b09": "offload", "b10": "offload",
    # issue 25's paths nobody graded (helper cov)
    "m60": "lifecycle", "m61": "memory", "m62": "lifecycle", "m63": "state", "m64": "precision",
    "m65": "checkpoint", "m66": "ownership", "m67": "state", "m68": "lifecycle",
}

KIND_OF.update({"m50": "waste", "m51": "async", "m52": "waste", "m53": "waste"})  # issue 25 (helper inv)
KIND_OF.update({"m69": "state", "m70": "memory", "m71": "precision", "m72": "checkpoint"})  # issue 32 (dtypes)
KIND_OF.update({"m80": "async", "m81": "async", "m82": "lifecycle"})  # issue 37 (what the public suite let through)
KIND_OF.update({"m83": "precision", "m84": "async", "m85": "lifecycle"})  # issue 41 (blind bugs the public suite missed)


def kind_of(mutant: Mutant) -> str:
    return KIND_OF.get(mutant.id, "?")


# ---- applying ------------------------------------------------------------------------------------------
def mutated_files(mutant: Mutant, root: Path = ROOT) -> dict[str, str]:
    files = reference_student_files(root)
    rel = f"fsdp_assignment/{TASK_FILES[mutant.task]}"
    count = files[rel].count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.id}: its `old` text occurs {count} times in {rel} (expected once): "
                         f"update the mutant to the current reference")
    files[rel] = files[rel].replace(mutant.old, mutant.new, 1)
    compile(files[rel], rel, "exec")
    return files


# ---- running -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    killer: str          # the first failing test's name ("" when it survived): its target's, else a public test's
    seconds: float
    detail: str = ""     # the killer's output, first lines; or why nothing failed
    tests: int = 0       # how many tests were graded (all runs together)
    public_killer: str = ""  # the public test that killed it, in a tree without the hidden tests ("" when none did)

    @property
    def public_killed(self) -> bool:
        return bool(self.public_killer)


def tests_for(mutant: Mutant, root: Path = ROOT, *, public: bool = False) -> list[str]:
    """The names of the graded tests that call a function the mutant edits (test_times.json), its target among them;
    empty when no traced test calls it (module-level code, a function added since the times were measured).
    ``public``: the public ones only, without the target."""
    name = TASK_FILES[mutant.task]
    source = reference_student_files(root)[f"fsdp_assignment/{name}"]
    calling = mutant_grading.tests_calling(name, mutant_grading.functions_edited(source, mutant.old))
    names = [nodeid.split("::", 1)[1] for nodeid, _ in calling if not public or nodeid.startswith("tests/public/")]
    if names and mutant.target and not public:
        names.append(mutant.target)  # the target always runs (first), traced calls or not
    return names


def runs_for(mutant: Mutant, root: Path = ROOT, *, public: bool = True,
             first: tuple[str, ...] = ()) -> list[tuple[str, list[str], bool]]:
    """The grading runs of one mutant, in order: (name, pytest arguments, public only). Each runs with -x:
    - "target": its target (the hidden test written for it) alone, when it has one: shown to do its job;
    - "public-calling": the public tests that call a function it edits, in a tree without the hidden tests;
    - "public": every public test, same tree (only when "public-calling" let it through, or selected nothing);
    - "hidden": the hidden tests, the public test files left out (they just passed), its target first (only when
      nothing killed it yet): a survivor has survived the whole suite.
    ``public=False`` (CI, which asks only whether the whole suite kills it): "calling", the tests of either suite
    that call a function it edits, its target first; then, if it survived them, "all", the whole suite. A mutant
    that only a hidden test kills then costs no run of the whole public suite. ``first`` (CI's runs only): tests
    to run next after the target, by name, e.g. the killer a full run recorded: the order changes, the suite
    judged does not (a mutant they no longer kill meets every other test still)."""
    order = ["--grade-first-task", str(mutant.task)]
    if not public:
        first = [arg for name in (mutant.target, *first) if name for arg in ("--grade-first", name)]
        calling = tests_for(mutant, root)
        return ([("calling", [*mutant_grading.select_args(calling), *order, *first], False)] if calling else []) + \
            [("all", [*order, *first], False)]
    calling = tests_for(mutant, root, public=True)
    runs = [("target", mutant_grading.select_args([mutant.target]), False)] if mutant.target else []
    if calling:
        runs.append(("public-calling", [*mutant_grading.select_args(calling), *order], True))
    runs.append(("public", order, True))
    ignore = [f"--ignore={f}" for f in mutant_grading.public_test_files(root)]
    runs.append(("hidden", [*ignore, *order, *(["--grade-first", mutant.target] if mutant.target else [])], False))
    return runs


def run_mutant(mutant: Mutant, workdir: Path, root: Path = ROOT, *, public: bool = True,
               public_only: bool = False, first: tuple[str, ...] = ()) -> Outcome:
    """Grade one mutant by ``runs_for``'s runs: its target; then the public suite alone (which decides the public
    kill rate); then, if nothing killed it, the hidden tests. The killer is the target when it killed it, else
    the first public test that did, else the hidden test that did. ``public=False``: ``runs_for``'s CI runs, and
    ``public_killer`` stays "" (not measured). ``public_only``: the public runs alone (no target, no hidden run),
    which is all the public kill rate needs; a mutant they let through is then reported as surviving."""
    files = mutated_files(mutant, root)
    seconds = graded = 0
    killer = detail = public_killer = ""
    for run, args, public_tree in runs_for(mutant, root, public=public, first=first):
        if run == "public" and public_killer or run in ("hidden", "all") and (killer or public_killer):
            continue
        if public_only and not public_tree:  # the target and the hidden run: not what the public rate needs
            continue
        v = mutant_grading.grade_mutant(files, workdir, f"{mutant.id}-{run}", args, root=root, public_only=public_tree)
        seconds, graded = seconds + v.seconds, graded + v.tests
        if v.killed and public_tree:
            public_killer = v.killer
        if v.killed and not killer:
            killer, detail = v.killer, v.detail
        if not killer:
            detail = v.detail
    return Outcome(mutant, bool(killer), killer, seconds, detail, graded, public_killer)


def run_all(mutants: list[Mutant], workers: int = 2, root: Path = ROOT, log=print, *,
            public: bool = True, public_only: bool = False,
            first: dict[str, tuple[str, ...]] | None = None) -> list[Outcome]:
    """Grade the mutants, ``workers`` at a time. ``first`` (with ``public=False``): per mutant id, tests to run
    first after its target (``runs_for``)."""
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-mutants-"))
    try:
        outcomes = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_mutant, m, workdir, root, public=public, public_only=public_only,
                                   first=(first or {}).get(m.id, ())): m for m in mutants}
            for future in concurrent.futures.as_completed(futures):
                outcome = future.result()
                hidden_only = public and outcome.killed and not outcome.public_killed
                log(f"{outcome.mutant.id} {'killed' if outcome.killed else 'SURVIVED'} in {outcome.seconds:5.1f} s"
                    f"{' by ' + outcome.killer if outcome.killed else ': ' + outcome.detail[:200]}"
                    f"{' (no public test kills it)' if hidden_only else ''}")
                outcomes.append(outcome)
        return sorted(outcomes, key=lambda o: o.mutant.id)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def kill_rates(outcomes: list[Outcome]) -> tuple[float, float]:
    """(the whole suite's kill rate, the public suite's own): killed / graded, killed by a public test / graded."""
    n = len(outcomes)
    return (sum(o.killed for o in outcomes) / n if n else 0.0, sum(o.public_killed for o in outcomes) / n if n else 0.0)


def hidden_only(outcomes: list[Outcome]) -> list[Outcome]:
    """The mutants that no public test kills but a hidden one does: bugs a student meets only in the grade."""
    return [o for o in outcomes if o.killed and not o.public_killed]


def report(outcomes: list[Outcome], *, public: bool = True) -> str:
    """The table, the kill rates and the coverage table. ``public=False``: the outcomes of CI's runs, where the
    public suite's own kill rate was not measured (said so, never printed as 0)."""
    lines = [f"{'mutant':<6} {'task':<4} {'kind':<12} {'result':<8} {'public':<6} {'seconds':>7}  killer / bug"]
    for o in outcomes:
        lines.append(f"{o.mutant.id:<6} {o.mutant.task:<4} {kind_of(o.mutant):<12} "
                     f"{'killed' if o.killed else 'SURVIVED':<8} "
                     f"{('yes' if o.public_killed else 'NO') if public else '?':<6} "
                     f"{o.seconds:7.1f}  {o.killer if o.killed else o.mutant.bug}")
    rate, public_rate = kill_rates(outcomes)
    n = len(outcomes)
    lines.append(f"kill rate {sum(o.killed for o in outcomes)}/{n} = {rate:.1%} (required {KILL_RATE_REQUIRED:.0%})")
    if not public:
        lines.append("public suite's own kill rate: not measured by these runs (python -m "
                     "staff.grader_selftest.mutations measures it)")
        return "\n".join(lines) + "\n\n" + coverage_table(outcomes)
    lines.append(f"public suite's own kill rate {sum(o.public_killed for o in outcomes)}/{n} = {public_rate:.1%} "
                 f"(killed by at least one public test; goal {PUBLIC_KILL_RATE_GOAL:.0%})")
    only = hidden_only(outcomes)
    lines.append(f"killed only by the hidden tests ({len(only)}): " + ("none" if not only else
                 "; ".join(f"{o.mutant.id} by {o.killer.split('::')[-1]}" for o in only)))
    return "\n".join(lines) + "\n\n" + coverage_table(outcomes)


def coverage_table(outcomes: list[Outcome]) -> str:
    """Per task (rows) and kind of bug (columns): killed/seeded mutants; '.' where no mutant probes it."""
    kinds = [k for k in KINDS if any(kind_of(o.mutant) == k for o in outcomes)]
    kinds += sorted({kind_of(o.mutant) for o in outcomes} - set(kinds))
    width = max([len(k) for k in kinds] + [5])
    lines = ["which kinds of bug the suite is shown to catch (killed/seeded mutants per task and kind):",
             "task  " + " ".join(f"{k:>{width}}" for k in kinds) + f" {'all':>{width}}"]
    for task in sorted({o.mutant.task for o in outcomes}):
        cells = []
        mine = [o for o in outcomes if o.mutant.task == task]
        for k in kinds + ["all"]:
            group = [o for o in mine if k == "all" or kind_of(o.mutant) == k]
            cells.append(f"{sum(o.killed for o in group)}/{len(group)}" if group else ".")
        lines.append(f"{task:<5} " + " ".join(f"{c:>{width}}" for c in cells))
    lines.append("kinds: " + "; ".join(f"{k}: {KINDS.get(k, '?')}" for k in kinds))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    parser.add_argument("--public-only", action="store_true",
                        help="grade the public tests alone (no target, no hidden run): the public kill rate only, "
                             "in about half the time; the whole suite's rate is then not measured")
    args = parser.parse_args(argv)
    by_id = {m.id: m for m in MUTANTS}
    unknown = [i for i in args.only or [] if i not in by_id]
    if unknown:
        parser.error(f"unknown mutant ids: {unknown}")
    mutants = MUTANTS if args.only is None else [by_id[i] for i in dict.fromkeys(args.only)]  # graded in this order
    if args.list:
        for m in mutants:
            print(f"{m.id} task {m.task} [{kind_of(m)}]: {m.bug}" + (f"  [issue: {m.issue_bug}]" if m.issue_bug else "")
                  + (f"  [target: {m.target}]" if m.target else ""))
        return 0
    for m in mutants:
        mutated_files(m)  # fail fast on a stale mutant
    start = time.monotonic()
    outcomes = run_all(mutants, workers=args.workers, public_only=args.public_only)
    print(report(outcomes))
    if args.public_only:
        print("--public-only: only the public suite ran; 'killed' and the kill rate above are the public suite's")
    print(f"wall time {time.monotonic() - start:.1f} s with {args.workers} workers")
    if args.json:
        args.json.write_text(json.dumps([{"id": o.mutant.id, "task": o.mutant.task, "kind": kind_of(o.mutant),
                                          "killed": o.killed, "killer": o.killer, "public_killer": o.public_killer,
                                          "seconds": round(o.seconds, 1), "bug": o.mutant.bug,
                                          "detail": o.detail} for o in outcomes], indent=1))
    rate, public_rate = kill_rates(outcomes)
    return 0 if rate >= KILL_RATE_REQUIRED and public_rate >= PUBLIC_KILL_RATE_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
