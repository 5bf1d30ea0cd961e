"""The broken-submission zoo: submissions made from the reference that misbehave on purpose, and what the grader
must do with each (tests/staff/test_zoo.py runs them in CI).

    python -m staff.grader_selftest.zoo                        # every case, ranks as this user
    python -m staff.grader_selftest.zoo --only hang raise --show  # some cases, with each broken test's output
    sudo python -m staff.grader_selftest.zoo --rank-user fsdp_student   # also the cases that need a rank user
    python -m staff.grader_selftest.zoo --hangs                # the hanging submissions graded in full (slow)

For every case: the tests it breaks score 0 with an output that says what happened, the other selected tests
are graded normally, the run ends by itself (a hang is cut at the case's timeout cap, not at grade.py's global
timeout; no wall-clock bound, so a loaded machine cannot fail a case), results.json is valid and genuine, and no
process of the run survives it (every process the run starts carries a marker in its environment; /proc is searched for
it afterwards). To keep CI quick each case grades a few chosen tests (``select``: a ``-k`` expression), not the
whole suite; tests/staff/test_autograder_bundle.py grades the whole suite end to end through the bundle.

Staff-only (it contains pieces of the solution); never in the bundle or the release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from staff.autograder import grade, results_schema
from staff.grader_selftest import mutations
from staff.grader_selftest.zoo_processes import TAG_VAR, kill_tagged, tagged_processes  # noqa: F401
from staff.grader_selftest.zoo_forgeries import FORGE, ISSUE14_HELPERS, RED_TEAM_HELPERS, STUB_FORGERY
from staff.grader_selftest.zoo_hangs import (HANG_CASES, HangCase, hang_case_files, inject_at_start,  # noqa: F401
                                             run_hang_case)

HERE = Path(__file__).resolve().parent

ROOT = HERE.parents[1]
RESULTS_VAR = "FSDP_ZOO_RESULTS"  # where a forging submission would write (the grader's own results path)
GLOBAL_TIMEOUT_S = 900            # grade.py's kill: far above a case's 10-20 s quiet, so only a real hang hits it

UNSHARD_START = "    flat_param.alloc_unsharded()\n    shard = flat_param.shard.detach()\n"
RESHARD_BODY = "    flat_param.free_unsharded()\n"
GRAD_2 = "test_unshard_gathers_every_rank_shard_and_reshard_frees[gloo-2]"
TIED_2 = "test_tied_parameters_are_stored_once"
CLIP = "test_clip_grad_norm_uses_the_global_norm"
RS_AVG = "test_reduce_scatter_averages_over_ranks"
ACCUMULATE = "test_gradient_accumulation_with_and_without_sync[True]"
SIBLING = "test_tie_across_sibling_units_is_rejected"
TIE_ONCE = "test_tied_weights_are_updated_once"
# The forgery is caught in the parent: by the evidence of sharding, or (since issue 35 every evidence test is
# witnessed, the tie test among them) first by the kernel's witness, whose readings a forged report skips.
FORGERY_CAUGHT = r"must own exactly the parameters of its subtree|the kernel's witness disagrees with this run"


@dataclass(frozen=True)
class Case:
    id: str
    what: str
    edits: tuple = ()                 # (task, old, new): old must occur once in that task file
    select: str = ""                  # -k expression
    broken: tuple = ()                # substrings of test names that must fail
    fine: tuple = ()                  # substrings of test names that must pass
    message: str = ""                 # regex every broken test's output must match
    timeout_cap: float = 6.0          # FSDP_RANK_TIMEOUT_CAP: harness timeouts (a hang costs this much)
    memory_mb: int = 256
    needs_rank_user: bool = False     # only meaningful when rank bodies run as another user
    forged_results: bool = False      # the submission writes a fake results.json
    stub_forgery: str = ""            # built from the stubs, plus STUB_FORGERY in this variant (no reference code)


def _insert(task: int, anchor: str, code: str) -> tuple:
    return (task, anchor, code + anchor)


CASES: list[Case] = [
    Case("hang", "a collective that only rank 0 calls (the others never join it)",
         edits=(_insert(3, UNSHARD_START,
                        "    if dist.get_rank() == 0:\n        dist.all_reduce(torch.zeros(3))  # zoo: rank 0 only\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"timed out after \d+ s: ranks? [\d, ]+ of 2 did not finish(?s:.*)in all_reduce(?s:.*)in unshard"),
    Case("raise", "one rank raises",
         edits=(_insert(3, RESHARD_BODY,
                        "    if dist.get_rank() == 1:\n        raise RuntimeError('zoo: rank 1 gives up')\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank 1 of 2 raised RuntimeError: zoo: rank 1 gives up"),
    Case("os_exit", "os._exit(0) in one rank",
         edits=(_insert(3, UNSHARD_START, "    if dist.get_rank() == 1:\n        import os\n        os._exit(0)\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank 1 of 2 exited with code 0 without reporting a result"),
    Case("sys_exit", "sys.exit(0) in one rank",
         edits=(_insert(3, UNSHARD_START, "    if dist.get_rank() == 1:\n        import sys\n        sys.exit(0)\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank 1 of 2 called sys\.exit\(0\)"),
    Case("abort", "os.abort() in one rank",
         edits=(_insert(3, UNSHARD_START, "    if dist.get_rank() == 0:\n        import os\n        os.abort()\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank 0 of 2 was killed by signal SIGABRT"),
    Case("endless_loop", "an endless Python loop in one rank",
         edits=(_insert(3, UNSHARD_START, "    while dist.get_rank() == 0:\n        pass\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"timed out after \d+ s: ranks? [\d, ]+ of 2 did not finish(?s:.*)line \d+ in unshard"),
    Case("import_error", "a task file imports a module that does not exist",
         edits=(_insert(6, "import torch.nn as nn\n", "import fsdp_zoo_no_such_module\n"),),
         select=f"test_prefetch_changes_no_number or {TIED_2}", broken=("test_prefetch_changes_no_number",),
         fine=(TIED_2,), message=r"ModuleNotFoundError: No module named 'fsdp_zoo_no_such_module'"),
    Case("syntax_error", "a task file does not parse",
         edits=((5, "def get_sharded_optimizer(", "def broken(:\n    pass\n\n\ndef get_sharded_optimizer("),),
         select=f"{CLIP} or {TIED_2}", broken=(CLIP,), fine=(TIED_2,),
         message=r"SyntaxError"),
    Case("memory_bomb", "allocates without bound (each rank has a memory limit)",
         edits=(_insert(5, "    grads = [fp.shard.grad for fp in flat_params",
                        "    _zoo = [torch.ones(1 << 22) for _ in range(100_000)]  # 16 MiB at a time, forever\n"),),
         select=f"{CLIP} or {TIED_2}", broken=(CLIP,), fine=(TIED_2,), memory_mb=256,
         message=r"out of memory"),
    Case("forged_results", "writes a fake results.json (full marks) and sums gradients instead of averaging",
         edits=((4, "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM"),
                _insert(4, "    if reduce_dtype is not None and unsharded_grad.dtype != reduce_dtype:\n",
                        "    _zoo_forge()\n")),
         select=f"{RS_AVG} or {TIED_2}", broken=(RS_AVG,), fine=(TIED_2,), forged_results=True,
         message=r"MEAN over ranks"),
    Case("patched_comparisons", "monkeypatches torch's comparisons to always agree, and sums instead of averaging",
         edits=((4, "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM"),
                _insert(4, "from .support.state import", "torch.allclose = lambda *a, **k: True\n"
                        "torch.equal = lambda *a, **k: True\ntorch.Tensor.__eq__ = lambda self, other: True\n"
                        "torch.testing.assert_close = lambda *a, **k: None\n")),
         select=f"{RS_AVG} or test_gradient_shards_match_single_process[gloo-2] or {TIED_2}",
         broken=(RS_AVG, "test_gradient_shards_match_single_process"), fine=(TIED_2,),
         message=r"(MEAN over ranks|relative error)"),
    Case("leftovers", "leaves a process group and a non-daemon thread behind (results correct)",
         edits=(_insert(7, "    if isinstance(module, FSDPModule):\n",
                        "    import threading, time\n    dist.new_group()\n"
                        "    threading.Thread(target=time.sleep, args=(3600,), name='zoo-leftover').start()\n"),),
         # not test_units_are_resharded_after_forward_and_backward: its 9 units would leak 9 gloo groups, ~110 MiB
         # of address space each, past RLIMIT_AS
         select=f"{ACCUMULATE} or {SIBLING}", fine=(ACCUMULATE, SIBLING)),
    Case("escaped_child", "starts a child process in its own session that would outlive the rank (results correct): "
         "a graded rank may start no process (issue 35), so the test fails with the grader's reason",
         edits=(_insert(7, "    if isinstance(module, FSDPModule):\n",
                        "    import subprocess\n    subprocess.Popen(['sleep', '600'], start_new_session=True)\n"),),
         select=f"{SIBLING}", broken=(SIBLING,), message=r"the grader refuses this system call in a rank",
         needs_rank_user=True),
    # Issue 14: forged passes, leaks of hidden tests, isolation, messages.
    Case("forged_pass", "walks the stack to the harness's rank main, takes the result connection (and the nonce "
         "it once held), sends 'ok' with a result of its own and leaves (the forgery that scored a stub 8.02)",
         edits=(_insert(3, UNSHARD_START, "    _zoo_forge_pass()\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank \d of 2 (exited with code 0 without reporting a result|announced a report of \d+ bytes|"
                 r"sent a report the parent cannot read|ended in the middle of its report)"),
    Case("output_link", "replaces its own output file with a link to a hidden test module, then fails",
         edits=(_insert(3, UNSHARD_START, "    _zoo_swap_output('link')\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank \d of 2 raised RuntimeError: zoo: swapped its output for a link"),
    Case("output_fifo", "replaces its own output file with a FIFO, then fails (the grader must not wait on it)",
         edits=(_insert(3, UNSHARD_START, "    _zoo_swap_output('fifo')\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"rank \d of 2 raised RuntimeError: zoo: swapped its output for a fifo"),
    Case("stopped", "rank 1 stops itself with SIGSTOP (its peer waits for it in a collective)",
         edits=(_insert(3, UNSHARD_START, "    if dist.get_rank() == 1:\n        import os, signal\n"
                                          "        os.kill(os.getpid(), signal.SIGSTOP)\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"^(?s:.*?)rank 1 of 2 was stopped \(SIGSTOP(?s:.*)in unshard"),
    Case("shared_memory_bomb", "allocates shared memory (MAP_SHARED) without bound: RLIMIT_DATA does not count it",
         edits=(_insert(5, "    grads = [fp.shard.grad for fp in flat_params",
                        "    import mmap\n    _zoo = []\n    while True:  # 64 MiB of shared memory at a time\n"
                        "        _zoo.append(mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED))\n"
                        "        _zoo[-1].write(b'x' * (64 << 20))\n"),),
         select=f"{CLIP} or {TIED_2}", broken=(CLIP,), fine=(TIED_2,), memory_mb=256,
         message=r"rank \d of \d+ raised (OSError|MemoryError)(?s:.*)out of memory"),
    # Issue 18: the stubs forgery in three variants (each claims success with the single-process, data-parallel
    # answer: values right, no sharding), and correct code that the old in-rank guard failed.
    Case("forged_stub_save", "stubs + wraps torch.serialization._save so a failed report becomes 'ok' with the "
         "single-process answer (scored 0.53 on this test against the old nonce/HMAC harness)",
         stub_forgery="save", select=TIE_ONCE, broken=(TIE_ONCE,), message=FORGERY_CAUGHT),
    Case("forged_stub_pipe", "stubs + writes a report with the single-process answer straight into the result pipe "
         "and exits 0 (the heap-read variant, without a secret to read)",
         stub_forgery="pipe", select=TIE_ONCE, broken=(TIE_ONCE,), message=FORGERY_CAUGHT),
    Case("forged_stub_subinterpreter", "stubs + the same report written with ctypes from a subinterpreter",
         stub_forgery="subinterpreter", select=TIE_ONCE, broken=(TIE_ONCE,), message=FORGERY_CAUGHT),
    Case("escapes", "raises with terminal escapes, an OSC hyperlink and a carriage return before a fake verdict",
         edits=(_insert(3, UNSHARD_START,
                        "    raise RuntimeError('zoo\\x1b[2K\\x1b[32m PASSED \\x1b]8;;http://x\\x07y\\x1b]8;;\\x07'\n"
                        "                       '\\r1 passed')\n"),),
         select=f"{GRAD_2} or {TIED_2}", broken=(GRAD_2,), fine=(TIED_2,),
         message=r"raised RuntimeError: zoo PASSED y(?s:.*)RuntimeError: zoo PASSED y\\r1 passed"),
    Case("ipc_and_lock_leftovers", "leaves a System V shared-memory segment, a semaphore set and a file in /run/lock "
         "(results correct)",
         edits=(_insert(7, "    if isinstance(module, FSDPModule):\n",
                        "    import ctypes, os\n    _libc = ctypes.CDLL(None)\n"
                        "    _libc.shmget(0, 1 << 20, 0o1600)\n    _libc.semget(0, 1, 0o1600)\n"
                        "    for _d in ('/run/lock', '/var/lock', '/dev/shm'):\n"
                        "        try:\n            open(os.path.join(_d, f'zoo-{os.getpid()}'), 'w').close()\n"
                        "        except OSError:\n            pass\n"),),
         select=f"{SIBLING}", fine=(SIBLING,), needs_rank_user=True),
    Case("debugging_leftovers", "correct code that calls gc.get_objects(), sys._current_frames() and malloc_trim "
         "through ctypes (the old guard closed the result channel: 28.74 of 100)",
         edits=(_insert(3, UNSHARD_START, "    import ctypes, gc, sys\n    gc.get_objects()\n"
                                          "    sys._current_frames()\n    ctypes.CDLL(None).malloc_trim(0)\n"),),
         select=f"{GRAD_2} or {TIED_2}", fine=(GRAD_2, TIED_2)),
    Case("chdir_at_import", "correct code that changes directory and sys.path when its module is imported",
         edits=((1, "import torch\n", "import os, sys\nos.chdir('/')\nsys.path[:] = [p for p in sys.path if p]"
                                       "\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
                                       "import torch\n"),),
         select=f"{GRAD_2} or {TIED_2} or test_training_matches_single_process_and_torch_fsdp2[gloo-2] or "
                f"test_meta_init_then_training_matches_eager",
         fine=(GRAD_2, TIED_2, "test_training_matches_single_process_and_torch_fsdp2[gloo-2]",
               "test_meta_init_then_training_matches_eager")),
    # Issue 25: the red team's list. Each needs the rank user (the grader's own situation on Gradescope).
    Case("deep_tree", "leaves a 1,500-deep folder tree under /tmp (results correct; shutil.rmtree's RecursionError "
         "in every later teardown scored the reference 35.79)",
         edits=(_insert(7, "    if isinstance(module, FSDPModule):\n", "    _zoo_deep_tree()\n"),),
         select=f"{ACCUMULATE} or {SIBLING}", fine=(ACCUMULATE, SIBLING), needs_rank_user=True),
    Case("detached_daemon", "rank 0 tries to leave a daemon (double fork, setsid) that, once its rank has ended, "
         "SIGKILLs every process of its user: the FSDP2 run the differential test makes next (results correct); a graded "
         "rank may start no process (issue 35), so the test fails with the grader's reason and nothing is left",
         edits=(_insert(7, "    if isinstance(module, FSDPModule):\n", "    _zoo_daemon()\n"),),
         select="test_generated_scripts_match_torch_fsdp2", broken=("test_generated_scripts_match_torch_fsdp2",),
         # the generated script catches the refusal where fully_shard must raise, and names it
         message=r"it raised PermissionError", needs_rank_user=True, timeout_cap=60.0),
    Case("hidden_shared_memory", "holds 1.2 GiB a rank in memfd files (refused in a graded rank) or else in /dev/shm "
         "files it unlinks at once: memory no listing of files finds (2 ranks, 2 GiB for the whole submission)",
         edits=(_insert(5, "    grads = [fp.shard.grad for fp in flat_params", "    _zoo_hidden_shm()\n"),),
         select=f"{CLIP} or {TIED_2}", broken=(CLIP,), fine=(TIED_2,), needs_rank_user=True,
         message=r"were all killed: together they used"),
]


def stub_files(root: Path = ROOT) -> dict[str, str]:
    """``fsdp_assignment/taskN_*.py`` -> the stub (what a student starts from)."""
    return {f"fsdp_assignment/{name}": (root / "fsdp_assignment" / name).read_text()
            for name in mutations.TASK_FILES.values()}


def case_files(case: Case, root: Path = ROOT) -> dict[str, str]:
    if case.stub_forgery:
        files = stub_files(root)
        for rel in files:
            files[rel] += STUB_FORGERY.replace("{variant}", case.stub_forgery)
        return files
    files = mutations.reference_student_files(root)
    for task, old, new in case.edits:
        rel = f"fsdp_assignment/{mutations.TASK_FILES[task]}"
        if files[rel].count(old) != 1:
            raise ValueError(f"zoo case {case.id}: {old!r} occurs {files[rel].count(old)} times in {rel}")
        files[rel] = files[rel].replace(old, new, 1)
    if case.forged_results:
        rel = f"fsdp_assignment/{mutations.TASK_FILES[4]}"
        files[rel] += FORGE
    if any("_zoo_forge_pass()" in new or "_zoo_swap_output(" in new for _, _, new in case.edits):
        rel = f"fsdp_assignment/{mutations.TASK_FILES[3]}"
        files[rel] += ISSUE14_HELPERS
    for task, _, new in case.edits:
        if "_zoo_deep_tree()" in new or "_zoo_daemon()" in new or "_zoo_hidden_shm()" in new:
            files[f"fsdp_assignment/{mutations.TASK_FILES[task]}"] += RED_TEAM_HELPERS
    return files


def hidden_lines(root: Path = ROOT) -> set[str]:
    """The hidden tests' own lines (40+ characters, stripped): none may appear in a visible test's output."""
    def lines_of(paths) -> set[str]:
        return {line.strip() for path in paths for line in path.read_text(encoding="utf-8").splitlines()
                if len(line.strip()) >= 40}
    public = lines_of([p for p in (root / "tests").rglob("*.py") if "hidden" not in p.parts]
                      + list((root / "fsdp_assignment").rglob("*.py")))
    return lines_of((root / "tests" / "hidden").rglob("*.py")) - public


# ---- processes -------------------------------------------------------------------------------------------
def leftovers_of(user: str) -> list[str]:
    """What the rank user still owns after a grading run: System V IPC objects, files in world-writable places."""
    import pwd
    from staff.autograder.cleanup import world_writable_places
    uid = pwd.getpwnam(user).pw_uid
    problems = []
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except OSError:
            continue
        left = sum(int(r[header.index("uid")]) == uid for r in rows)
        if left:
            problems.append(f"{left} System V {kind} object(s) of {user} left after grading")
    for place in world_writable_places():
        try:
            mine = [e.path for e in os.scandir(place) if e.stat(follow_symlinks=False).st_uid == uid]
        except OSError:
            continue
        if mine:
            problems.append(f"files of {user} left in {place}: {mine[:5]}")
    return problems


# ---- running a case ---------------------------------------------------------------------------------------
@dataclass
class Result:
    case: Case
    seconds: float
    problems: list = field(default_factory=list)
    results: dict | None = None
    survivors: list = field(default_factory=list)
    grader_output: str = ""


def run_case(case: Case, workdir: Path, *, rank_user: str = "none", root: Path = ROOT) -> Result:
    tree = workdir / case.id
    mutations.stage_tree(tree, case_files(case, root), root)
    results_dir = workdir / f"{case.id}-results"
    results_dir.mkdir(parents=True, exist_ok=True)
    results = results_dir / "results.json"
    tag = uuid.uuid4().hex
    env = dict(os.environ, **{TAG_VAR: tag})
    if case.forged_results:
        env[RESULTS_VAR] = str(results)
    cmd = grade.command("--results", str(results), "--rank-user", rank_user, "--timeout", str(GLOBAL_TIMEOUT_S),
                        "--timeout-cap", f"{case.timeout_cap:g}", "--rank-memory-mb", str(case.memory_mb),
                        "--", "-k", case.select)
    if rank_user != "none":
        grade.lock_down(tree)
        os.chmod(results_dir, 0o700)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    time.sleep(0.2)
    out = Result(case, seconds, grader_output=proc.stdout[-6000:] + proc.stderr[-2000:])
    out.survivors = tagged_processes(tag)
    kill_tagged(tag)
    if rank_user != "none":
        out.problems += leftovers_of(rank_user)
    if out.survivors:
        out.problems.append(f"processes survived the run: {out.survivors}")
    if "the grading run exceeded" in proc.stdout:
        out.problems.append(f"the run did not end by itself: grade.py killed it after {GLOBAL_TIMEOUT_S} s "
                            f"({seconds:.1f} s)")
    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError) as err:
        out.problems.append(f"no valid results.json: {err}")
        return out
    out.results = data
    out.problems += [f"schema: {p}" for p in results_schema.validate(data)]
    if "has not finished" in data.get("output", ""):
        out.problems.append("results.json says the grading run did not finish")
    tests = data.get("tests", [])
    if not tests:
        out.problems.append("results.json lists no tests")
    if data.get("output") == "forged" or any("forged" in t.get("output", "") for t in tests):
        out.problems.append("the forged results.json survived")
    for t in [data] + tests:
        if re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", t.get("output", "")):
            out.problems.append(f"{t.get('name', 'top-level output')}: control characters or escapes in the output")
    if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", proc.stdout):
        out.problems.append("control characters or escapes in the grading log")
    secret = hidden_lines(root)
    for t in tests:
        if t.get("visibility") == "visible":
            leaked = [line for line in t["output"].splitlines() if line.strip() in secret]
            if leaked:
                out.problems.append(f"{t['name']} (visible) quotes hidden test code: {leaked[:3]}")
    for pattern in case.broken:
        hit = [t for t in tests if pattern in t["name"]]
        if not hit:
            out.problems.append(f"no test matching {pattern!r} was graded")
        for t in hit:
            if t["status"] != "failed" or t["score"] != 0:
                out.problems.append(f"{t['name']}: {t['status']} with {t['score']} points; it must fail")
            elif case.message and not re.search(case.message, t["output"]):
                out.problems.append(f"{t['name']}: output does not explain ({case.message!r} not found):\n"
                                    f"{t['output'][:1500]}")
    for pattern in case.fine:
        hit = [t for t in tests if pattern in t["name"]]
        if not hit:
            out.problems.append(f"no test matching {pattern!r} was graded")
        for t in hit:
            if t["status"] != "passed":
                out.problems.append(f"{t['name']}: {t['status']}; it must pass:\n{t['output'][:1500]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--rank-user", default="none")
    parser.add_argument("--show", action="store_true", help="print each broken test's output")
    parser.add_argument("--hangs", action="store_true",
                        help="grade the hanging submissions (HANG_CASES) in full instead, and report their scores")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-zoo-"))
    os.chmod(workdir, 0o755)
    if args.hangs:
        try:
            failed = 0
            for case in HANG_CASES:
                if args.only is not None and case.id not in args.only:
                    continue
                r = run_hang_case(case, workdir)
                failed += bool(r["problems"])
                print(json.dumps({k: v for k, v in r.items() if k != "summary"}, indent=1))
                print(r["summary"])
            return 1 if failed else 0
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = 0
    try:
        for case in CASES:
            if args.only is not None and case.id not in args.only:
                continue
            if case.needs_rank_user and args.rank_user == "none":
                print(f"{case.id:<20} skipped (needs --rank-user)")
                continue
            r = run_case(case, workdir, rank_user=args.rank_user)
            failed += bool(r.problems)
            print(f"{case.id:<20} {'ok' if not r.problems else 'FAILED'} in {r.seconds:.1f} s")
            for p in r.problems:
                print("    " + p.replace("\n", "\n    "))
            if args.show and r.results:
                for t in r.results["tests"]:
                    if any(b in t["name"] for b in case.broken):
                        print("    | " + t["output"][:2500].replace("\n", "\n    | "))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
