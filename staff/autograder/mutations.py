"""Mutation self-test: seeded single-point bugs of the reference that the public + hidden suite must catch.

    python staff/autograder/mutations.py                 # every mutant, 2 workers; exit 1 below the kill rate
    python staff/autograder/mutations.py --only m11 m15  # some of them
    python staff/autograder/mutations.py --list          # what each one seeds

Each mutant is one edit (``old`` -> ``new``, ``old`` must occur exactly once) of one reference task file. For a
mutant, the seven reference task files are rewritten in the students' layout (``from ..support`` ->
``from .support``), the edit is applied, and they are installed as the student files of a fresh grading tree
(the bundle's tree, ``build_bundle.stage``). The grading command then runs the public and hidden tests with
``-x``, the mutated task's tests first (and first of all the hidden test written for this bug, if any). The
mutant is killed when a test fails; the first failing test is its killer.

The list covers every bug named in the autograder issue (``issue_bug``) and more. ``target`` names the hidden
test meant to catch a bug that the public tests miss: that test runs first, so the report shows whether it
does its job. Every hidden test is the target of at least one mutant.

Mutants are staff-only (they contain pieces of the solution) and never go into the bundle or the release.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILL_RATE_REQUIRED = 0.95

TASK_FILES = {1: "task1_meta_init.py", 2: "task2_flat_param.py", 3: "task3_forward.py",
              4: "task4_backward.py", 5: "task5_optim_ckpt.py", 6: "task6_prefetch.py",
              7: "task7_fully_shard.py"}


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


@dataclass(frozen=True)
class Mutant:
    id: str
    task: int              # the task file edited
    old: str
    new: str
    bug: str               # the student's mistake it stands for
    issue_bug: str = ""    # the bug of the issue's list it seeds ("" when it is an extra)
    target: str = ""       # a hidden test that catches it, run first ("" when the public tests suffice)


MUTANTS: list[Mutant] = [
    # ---- Task 1: meta-device init ------------------------------------------------------------------------
    Mutant("m01", 1, "    for sub in module.modules():\n        own_params =",
           "    for sub in reversed(list(module.modules())):\n        own_params =",
           "materializes children before parents: the RNG is replayed in another order",
           "meta init that consumes the RNG in another order"),
    Mutant("m02", 1, "        owned = sharded_owned.get(id(sub), [])\n",
           "        owned = [o for o in sharded_owned.get(id(sub), [])\n"
           "                 if (id(o[0]), o[0].aliases[o[1]]) not in initialized]\n",
           "skips the later owner of a tied weight in sharded units, so its init never consumes random numbers",
           "meta init that consumes the RNG in another order", "test_sharded_meta_init_replays_the_rng_exactly"),
    Mutant("m03", 1, "            if key not in initialized:  # a tied alias seen again only consumed random numbers\n",
           "            if True:\n",
           "a tied weight takes the value of its later owner's init (the scratch init is copied into the shard)",
           "tied weights updated twice, or once on the wrong rank"),
    Mutant("m04", 1, "            delattr(sub, attr)  # the full tensor is freed here\n", "            pass\n",
           "keeps every module's full parameters alive after copying its slice: the whole model materializes"),
    Mutant("m05", 1, "        if not hasattr(sub, \"reset_parameters\"):\n",
           "        if False:\n",
           "no TypeError for a module that owns meta state but has no reset_parameters()",
           "", "test_module_without_reset_parameters_is_rejected"),
    Mutant("m06", 1, "        for name, b in own_buffers:\n            sub._buffers[name] = torch.empty(",
           "        for name, b in own_buffers:\n            continue\n            sub._buffers[name] = torch.empty(",
           "buffers are left on the meta device"),
    # ---- Task 2: FlatParameter ---------------------------------------------------------------------------
    Mutant("m07", 2, "self.padded_numel = -(-self.numel // world_size) * world_size",
           "self.padded_numel = self.numel // world_size * world_size",
           "pads down (floor) instead of up: the last elements are lost when W does not divide numel",
           "padding wrong when W does not divide numel", "test_padding_edge_cases"),
    Mutant("m08", 2, "self.padded_numel = -(-self.numel // world_size) * world_size",
           "self.padded_numel = (self.numel // world_size + 1) * world_size",
           "always adds padding, a whole extra W elements when W divides numel",
           "padding wrong when W does not divide numel", "test_padding_edge_cases"),
    Mutant("m09", 2, "self.shard = nn.Parameter(torch.zeros(self.shard_numel",
           "self.shard = nn.Parameter(torch.ones(self.shard_numel",
           "the shard is not zero-initialized, so its padding is garbage",
           "padding wrong when W does not divide numel"),
    Mutant("m10", 2, "            if id(param) not in unique:\n                unique[id(param)] = (name, param)\n"
                     "                self.param_names.append(name)\n            self.aliases[name] = unique[id(param)][0]",
           "            if name not in unique:\n                unique[name] = (name, param)\n"
           "                self.param_names.append(name)\n            self.aliases[name] = unique[name][0]",
           "deduplicates by name instead of identity: a tied weight is flattened, and updated, twice",
           "tied weights updated twice, or once on the wrong rank"),
    Mutant("m11", 2, "        \"\"\"Free the unsharded buffer's memory by resizing its storage to 0 bytes (views stay valid "
                     "objects).\"\"\"\n        self.unsharded.untyped_storage().resize_(0)\n",
           "        \"\"\"Free the unsharded buffer's memory by resizing its storage to 0 bytes (views stay valid "
           "objects).\"\"\"\n        fresh = torch.empty(self.padded_numel, dtype=self.unsharded.dtype, "
           "device=self.unsharded.device)\n        fresh.untyped_storage().resize_(0)\n"
           "        self.unsharded.data = fresh\n",
           "'frees' by pointing the buffer at a new empty storage: the old one lives on in the views",
           "a reshard that drops the reference but keeps the storage", "test_reshard_really_frees_memory"),
    Mutant("m12", 2, "        return lo - self.param_offsets[i], hi - self.param_offsets[i], lo - self.shard_offset",
           "        return lo - self.param_offsets[i], hi - self.param_offsets[i], lo",
           "uses the flat offset, not the offset inside the shard: pieces land on the wrong rank's slots",
           "tied weights updated twice, or once on the wrong rank", "test_padding_edge_cases"),
    # ---- Task 3: forward -----------------------------------------------------------------------------------
    Mutant("m13", 3, "        if unit.reshard_after_forward:\n            reshard_unit(unit)",
           "        if False:\n            reshard_unit(unit)",
           "never reshards after forward"),
    Mutant("m14", 3, "    elif unit.sharded_state == ShardedState.SHARDED:\n        for flat_param in unit.flat_params:\n"
                     "            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)\n"
                     "    for flat_param in unit.flat_params:\n        flat_param.use_unsharded_views()\n",
           "    elif unit.sharded_state == ShardedState.SHARDED:\n        for flat_param in unit.flat_params:\n"
           "            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)\n"
           "            flat_param.use_unsharded_views()\n",
           "sets the views only when it gathers: views made under no_grad stay and cut the gradient path",
           "", "test_eval_under_no_grad_then_train"),
    Mutant("m15", 3, "    if param_dtype is not None and shard.dtype != param_dtype:\n        shard = shard.to(param_dtype)\n",
           "",
           "all-gathers the fp32 shard into the low-precision buffer (no cast to param_dtype)", "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m16", 3, "    if unit.param_dtype is None or not unit.cast_forward_inputs:",
           "    if True:", "never casts forward inputs to param_dtype", "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    # ---- Task 4: backward ---------------------------------------------------------------------------------
    Mutant("m17", 4, "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM",
           "sums gradients over ranks instead of averaging", "gradients summed instead of averaged", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m18", 4, "        unit.training_state = TrainingState.PRE_BACKWARD\n        wait_for_unshard(unit)\n",
           "        unit.training_state = TrainingState.PRE_BACKWARD\n",
           "does not re-gather a resharded unit before its backward",
           "no re-gather in backward after reshard"),
    Mutant("m19", 4, "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n",
           "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n        grad[flat_param.numel:] = 1.0\n",
           "the padded flat gradient's padding is garbage (built with torch.empty), and is reduced as is",
           "padding gradients not zeroed", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m20", 6, "        for pending in shared.pending_reduce_scatters:\n            _finish_reduce_scatter(pending)\n",
           "",
           "backward returns with the last async reduce-scatter unfinished: its gradient is missing at step()",
           "reduce-scatter not finished before step",
           "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("m21", 4, "        flat_param.shard.grad += grad_shard", "        flat_param.shard.grad = grad_shard",
           "overwrites the shard's gradient instead of accumulating into it",
           "", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m22", 4, "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n", "        grad = grad.to(grad.dtype)\n",
           "reduce-scatters in the parameters' dtype (bf16), ignoring reduce_dtype",
           "mixed precision reducing in the wrong dtype",
           "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m23", 4, "            grad = flat_param.unsynced_grad.add_(grad)\n", "            grad = grad\n",
           "gradient accumulation keeps only the last micro-batch's gradient",
           "gradient accumulation that syncs too early or drops a micro-batch", "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m24", 4, "            grad = flat_param.unsynced_grad.add_(grad)\n            flat_param.unsynced_grad = None\n",
           "            grad = flat_param.unsynced_grad.add_(grad)\n",
           "the accumulated unsynced gradient is never cleared: it is added again in the next step",
           "gradient accumulation that syncs too early or drops a micro-batch",
           "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m25", 4, "                self.post_backward(unit)\n        self.wait_for_reductions(shared)\n",
           "                pass\n        self.wait_for_reductions(shared)\n",
           "no backstop in the final callback: units whose post-backward autograd never ran (the root, whose input "
           "needs no gradient; unused units) are neither reduced nor resharded"),
    # ---- Task 5: optimizer, clipping, checkpoints ---------------------------------------------------------
    Mutant("m26", 5, "    dist.all_reduce(local_sq)  # sum of squares over all ranks: the global squared norm\n", "",
           "clips by the local norm of this rank's shards", "clip norm computed locally", "test_clip_grad_norm_below_max_norm_changes_nothing"),
    Mutant("m27", 5, "    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)",
           "    clip_coef = max_norm / (total_norm + 1e-6)",
           "scales gradients up when their norm is below max_norm",
           "", "test_clip_grad_norm_below_max_norm_changes_nothing"),
    Mutant("m28", 5, "    return optimizer_cls([p for p in module.parameters() if p.requires_grad], **kwargs)",
           "    return optimizer_cls([fp.unsharded for _, fp in named_flat_params(module) if fp.requires_grad], "
           "**kwargs)",
           "builds the optimizer over the full (unsharded) flat parameters: state for the whole model on every rank",
           "optimizer state replicated instead of sharded"),
    Mutant("m29", 5, "                out[prefix + name] = flat_param.shard.detach()[at:at + end - start].clone()",
           "                out[prefix + name] = flat_param.shard.detach()[start:end].clone()",
           "sharded state dict slices the shard with the parameter's offsets, not the shard's"),
    Mutant("m30", 5, "                t = torch.zeros_like(shard)  # padding stays zero",
           "                t = torch.ones_like(shard)",
           "loading optimizer state leaves garbage in the padding (torch.empty_like), which leaks into the shard",
           "", "test_resume_keeps_padding_zero_and_matches"),
    Mutant("m31", 5, "    return {alias: unique[name] for alias, name in flat_param.aliases.items()}",
           "    return unique",
           "full state dicts list a tied weight under one of its names only"),
    # ---- Task 6: prefetching -----------------------------------------------------------------------------
    Mutant("m32", 6, "        if i + 1 < len(order):\n            _issue_unshard(order[i + 1])",
           "        for later in order[i + 1:]:\n            _issue_unshard(later)",
           "prefetches every later unit: all of them are unsharded at once",
           "prefetch that waits on the wrong handle or keeps every unit unsharded"),
    Mutant("m33", 6, "        if i + 1 < len(order):\n            _issue_unshard(order[i + 1])",
           "        if i + 1 < len(order):\n            later = order[i + 1]\n"
           "            if later.sharded_state == ShardedState.SHARDED and not later.pending_unshard:\n"
           "                for flat_param in later.flat_params:\n"
           "                    unit.pending_unshard.append(unshard(flat_param, later.group, "
           "param_dtype=later.param_dtype, async_op=True))",
           "keeps the prefetch handle on the wrong unit: the prefetched unit does not find it and gathers again",
           "prefetch that waits on the wrong handle or keeps every unit unsharded",
           "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("m34", 6, "        if i >= 1:\n            _issue_unshard(order[i - 1])",
           "        if i + 1 < len(order):\n            _issue_unshard(order[i + 1])",
           "backward prefetch goes the wrong way (the forward order instead of its reverse)"),
    # ---- Task 7: fully_shard ------------------------------------------------------------------------------
    Mutant("m35", 7, "        if name.rpartition(\".\")[2] in FLAT_PARAM_NAMES:\n            continue\n", "",
           "a parent unit flattens its children's flat parameters again",
           "nested units' parameters counted twice"),
    Mutant("m36", 7, "                    reduce_dtype=(mp.reduce_dtype or param_dtype) if mp is not None else None,",
           "                    reduce_dtype=param_dtype,",
           "ignores MixedPrecisionPolicy.reduce_dtype: reduces in param_dtype",
           "mixed precision reducing in the wrong dtype",
           "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m37", 7, "    for unit in fsdp_units(module):\n        unit.requires_gradient_sync = requires_gradient_sync",
           "    for unit in fsdp_units(module)[:1]:\n        unit.requires_gradient_sync = requires_gradient_sync",
           "set_requires_gradient_sync reaches the root unit only: the others sync every micro-batch",
           "gradient accumulation that syncs too early or drops a micro-batch", "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m38", 7, "    unit = FSDPUnit(module=module, flat_params=flat_params, reshard_after_forward=reshard_after_forward,",
           "    unit = FSDPUnit(module=module, flat_params=flat_params, reshard_after_forward=True,",
           "ignores fully_shard(reshard_after_forward=False)",
           "", "test_reshard_after_forward_false_via_fully_shard"),
    Mutant("m39", 7, "        if child_params.get(id(param)) is param:\n",
           "        if False:\n",
           "silently flattens a weight tied to a child unit's a second time (unties it)",
           "tied weights updated twice, or once on the wrong rank"),
]


# ---- applying ------------------------------------------------------------------------------------------
def student_form(text: str) -> str:
    """A reference task file as it would sit in the students' package (fsdp_assignment/)."""
    text = re.sub(r"^(\s*)from(\s+)\.\.", r"\1from\2.", text, flags=re.MULTILINE)
    return text.replace("fsdp_assignment.reference.", "fsdp_assignment.")


def reference_student_files(root: Path = ROOT) -> dict[str, str]:
    """``fsdp_assignment/taskN_*.py`` -> the reference's code in the student layout."""
    return {f"fsdp_assignment/{name}": student_form((root / "fsdp_assignment" / "reference" / name).read_text())
            for name in TASK_FILES.values()}


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
    killer: str          # the first failing test's name ("" when it survived)
    seconds: float
    detail: str = ""     # the killer's output, first lines; or why nothing failed


def stage_tree(dest: Path, files: dict[str, str], root: Path = ROOT) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import build_bundle
    finally:
        sys.path.pop(0)
    build_bundle.stage(dest, root)
    for rel, text in files.items():
        (dest / rel).write_text(text)


def grade(tree: Path, results: Path, pytest_args: list[str], *, timeout: float = 600, timeout_cap: float = 45,
          env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(tree / "staff" / "autograder" / "grade.py"), "--results", str(results),
           "--rank-user", "none", "--timeout", f"{timeout:g}", "--timeout-cap", f"{timeout_cap:g}", "--", *pytest_args]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env, timeout=timeout + 120)


def first_failure(results: dict) -> dict | None:
    """The first test, in run order, that ran and failed (not one marked 'not run')."""
    for t in results.get("tests", []):
        body = t["output"].split("\n\n", 1)[-1]
        if t["status"] == "failed" and not body.startswith(("not run", "did not finish")):
            return t
    return None


def run_mutant(mutant: Mutant, workdir: Path, root: Path = ROOT) -> Outcome:
    start = time.monotonic()
    tree = workdir / mutant.id
    stage_tree(tree, mutated_files(mutant, root), root)
    results = workdir / f"{mutant.id}.json"
    args = ["-x", "--grade-first-task", str(mutant.task)]
    if mutant.target:
        args += ["--grade-first", mutant.target]
    proc = grade(tree, results, args)
    seconds = time.monotonic() - start
    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError):
        return Outcome(mutant, False, "", seconds, f"no results.json; grader output:\n{proc.stdout[-2000:]}")
    failed = first_failure(data)
    shutil.rmtree(tree, ignore_errors=True)
    if not data.get("tests"):
        raise RuntimeError(f"{mutant.id}: the grading run graded no test; grader output:\n{proc.stdout[-3000:]}")
    if failed is None:
        return Outcome(mutant, False, "", seconds, f"all {len(data['tests'])} tests passed")
    body = failed["output"].split("\n\n", 2)[-1]
    return Outcome(mutant, True, failed["name"], seconds, body[:400])


def run_all(mutants: list[Mutant], workers: int = 2, root: Path = ROOT, log=print) -> list[Outcome]:
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-mutants-"))
    try:
        outcomes = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_mutant, m, workdir, root): m for m in mutants}
            for future in concurrent.futures.as_completed(futures):
                outcome = future.result()
                log(f"{outcome.mutant.id} {'killed' if outcome.killed else 'SURVIVED'} in {outcome.seconds:5.1f} s"
                    f"{' by ' + outcome.killer if outcome.killed else ': ' + outcome.detail[:200]}")
                outcomes.append(outcome)
        return sorted(outcomes, key=lambda o: o.mutant.id)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def report(outcomes: list[Outcome]) -> str:
    killed = [o for o in outcomes if o.killed]
    lines = [f"{'mutant':<6} {'task':<4} {'result':<8} {'seconds':>7}  killer / bug"]
    for o in outcomes:
        lines.append(f"{o.mutant.id:<6} {o.mutant.task:<4} {'killed' if o.killed else 'SURVIVED':<8} "
                     f"{o.seconds:7.1f}  {o.killer if o.killed else o.mutant.bug}")
    rate = len(killed) / len(outcomes) if outcomes else 0.0
    lines.append(f"kill rate {len(killed)}/{len(outcomes)} = {rate:.1%} (required {KILL_RATE_REQUIRED:.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only is None or m.id in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.id} task {m.task}: {m.bug}" + (f"  [issue: {m.issue_bug}]" if m.issue_bug else "")
                  + (f"  [target: {m.target}]" if m.target else ""))
        return 0
    for m in mutants:
        mutated_files(m)  # fail fast on a stale mutant
    start = time.monotonic()
    outcomes = run_all(mutants, workers=args.workers)
    print(report(outcomes))
    print(f"wall time {time.monotonic() - start:.1f} s with {args.workers} workers")
    if args.json:
        args.json.write_text(json.dumps([{"id": o.mutant.id, "task": o.mutant.task, "killed": o.killed,
                                          "killer": o.killer, "seconds": round(o.seconds, 1), "bug": o.mutant.bug,
                                          "detail": o.detail} for o in outcomes], indent=1))
    rate = sum(o.killed for o in outcomes) / len(outcomes) if outcomes else 0.0
    return 0 if rate >= KILL_RATE_REQUIRED else 1


if __name__ == "__main__":
    sys.exit(main())
