"""Real SLURM round trips: benchmarks and a training run through submitit, on one node and across two, plus the
queue cases (a request that can never run, a job that pends longer than the run timeout, a driver killed
mid-sweep) and torchrun across the two nodes.

Needs a reachable SLURM cluster: `sudo bash benchmarks/slurm/slurm_up.sh --nodes 2` brings up a two-node cluster on
this machine (network namespaces fsdpn1/fsdpn2; `slurm_up.sh` alone: one node on 127.0.0.1), and
`bash benchmarks/slurm/slurm_down.sh` stops it. Without a cluster every test here is skipped and says why, unless
FSDP_REQUIRE_SLURM=1 (CI, which starts the cluster first): then a missing cluster is a failure. The two-node tests
skip only when FSDP_SLURM_NO_NETNS says why the namespaces could not be made (CI sets it from slurm_up.sh's error).
All are marked slow (`-m "not slow"` leaves them out; CI runs them). The tests start no daemons; blocker jobs and driver processes they start are stopped by id in `finally`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| collective | W | interconnect | size | time us | algbw GB/s | busbw GB/s |"
NODES = ("fsdpn1", "fsdpn2")


def _slurm_problem() -> str | None:
    """None when a SLURM controller answers and has a usable node; otherwise what is missing."""
    for tool in ("sbatch", "sinfo", "scontrol", "squeue"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (no SLURM client installed; benchmarks/slurm/slurm_up.sh installs one)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "the SLURM controller did not answer within 15 s"
    if "UP" not in ping.stdout:
        return f"`scontrol ping` says the controller is not up: {(ping.stdout + ping.stderr).strip()!r}"
    usable = {"idle", "mixed", "allocated", "completing"}
    if not any(s.strip().rstrip("*~#!%$@^-") in usable and not s.strip().endswith("*") for s in states.stdout.split()):
        return f"no usable SLURM node (sinfo states: {states.stdout.split()})"
    return None


def require_slurm() -> None:
    """Skip (or, with FSDP_REQUIRE_SLURM=1, fail) when no SLURM cluster is reachable."""
    problem = _slurm_problem()
    if problem is None:
        return
    if os.environ.get("FSDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"FSDP_REQUIRE_SLURM=1 but SLURM is not reachable: {problem}. "
                    f"Start it with `bash benchmarks/slurm/slurm_up.sh --nodes 2` (as root).", pytrace=False)
    pytest.skip(f"SLURM not reachable: {problem}. `sudo bash benchmarks/slurm/slurm_up.sh --nodes 2` starts a local "
                f"two-node cluster (FSDP_REQUIRE_SLURM=1 turns this skip into a failure)")


def require_two_nodes() -> None:
    """The two-node cluster of benchmarks/slurm/slurm_up.sh --nodes 2: nodes fsdpn1 and fsdpn2 idle, namespaces up."""
    require_slurm()
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=15).stdout
    states = dict(line.split()[:2] for line in nodes.splitlines() if line.strip())
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if shutil.which("ip") else ""
    ok = all(states.get(n, "").rstrip("*~#!%$@^-") in {"idle", "mixed", "allocated", "completing"} for n in NODES)
    if ok and all(n in netns for n in NODES):
        return
    problem = f"the two-node cluster is not up (sinfo: {states}; network namespaces: {netns.split()})"
    why_not = os.environ.get("FSDP_SLURM_NO_NETNS")
    if why_not:
        pytest.skip(f"two-node SLURM tests skipped: this machine cannot make network namespaces: {why_not}")
    if os.environ.get("FSDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"FSDP_REQUIRE_SLURM=1 but {problem}. Start it with "
                    f"`bash benchmarks/slurm/slurm_up.sh --nodes 2`.", pytrace=False)
    pytest.skip(f"{problem}; `sudo bash benchmarks/slurm/slurm_up.sh --nodes 2` starts it")


def require_own_namespaces() -> None:
    """torchrun_2nodes.sh runs in the namespaces only for the checkout(s) that brought the cluster up (its owners
    file): another checkout's cluster on this machine (e.g. the staff CI's, seen from a release built inside it)
    is a skip that names the owner, or a failure with FSDP_REQUIRE_SLURM=1."""
    owners = Path(os.environ.get("FSDP_SLURM_ROOT", "/var/spool/fsdp-slurm")) / "owners"
    me = os.environ.get("FSDP_SLURM_OWNER", str(ROOT))
    listed = [line for line in owners.read_text().splitlines() if line.strip()] if owners.is_file() else []
    if not listed or me in listed or any(Path(o).resolve() == Path(me).resolve() for o in listed):
        return
    problem = (f"the two-node namespaces belong to another caller's cluster ({', '.join(listed)}), not to {me}; "
               f"`FSDP_SLURM_SHARE=1 bash benchmarks/slurm/slurm_up.sh --nodes 2` joins it")
    if os.environ.get("FSDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"FSDP_REQUIRE_SLURM=1 but {problem}", pytrace=False)
    pytest.skip(problem)


def _parser():
    from benchmarks import cli

    p = cli.base_parser("probe")
    cli.world_sizes_arg(p, [2])
    return p


def _args(out: Path, *flags: str):
    """Parsed benchmark flags for a probe sweep (benchmarks.launch:probe, the smallest worker)."""
    from benchmarks import cli

    return cli.parse(_parser(), ["--launcher", "slurm", "--out", str(out), "--slurm-time-min", "5", *flags], "probe")


def _manifest(out: Path, name: str) -> Path | None:
    """The manifest of the sweep a driver is running in ``out`` (each run has a folder of its own)."""
    found = sorted(out.glob(f"{name}.sweep*/manifest.json"))
    return found[-1] if found else None


# ---- one node or two: a benchmark's table comes back ----------------------------------------------------
@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(300)
def test_benchmark_through_submitit_returns_its_table(tmp_path):
    """bench_comm at a tiny size as one submitit job with 2 tasks: the tasks rendezvous over TCP at the job's first
    node, run the collectives and a counted DDP step, and their results come back into the same table."""
    require_slurm()
    from benchmarks import bench_comm

    raw = bench_comm.main(["--launcher", "slurm", "--world-sizes", "2", "--max-size", "16KiB", "--budget", "0.01",
                           "--strategies", "DDP (torch)", "--params", "2e5", "--layers", "2", "--block-size", "16",
                           "--slurm-time-min", "5", "--timeout", "240", "--out", str(tmp_path), "--quiet"])
    md = (tmp_path / "comm.md").read_text()
    assert HEADER in md
    assert "| all-gather | 2 | gloo (real) | 1 KiB |" in md
    assert "| DDP (torch) | 2 |" in md  # the counted step came back too
    saved = json.loads((tmp_path / "comm.json").read_text())
    assert saved["config"]["launcher"] == "slurm"
    assert raw["bytes_per_step"][0]["ratio"] == pytest.approx(1.0, abs=0.01)  # DDP: 2Ψ(W-1)/W
    # the job really went through SLURM: submitit left the two tasks' logs in its folder
    logs = sorted(p.name for p in (tmp_path / "slurm").glob("*_log.out"))
    assert any(name.endswith("_0_log.out") for name in logs) and any(name.endswith("_1_log.out") for name in logs), logs
    # --collect rebuilds the very same table from the sweep's saved results
    bench_comm.main(["--collect", str(tmp_path), "--out", str(tmp_path / "again"), "--quiet"])
    assert (tmp_path / "again" / "comm.md").read_text() == md


# ---- two nodes -----------------------------------------------------------------------------------------
def _train_table(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| W ") and "---" not in line]


@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(420)
def test_submitit_two_nodes_trains_like_one_process(tmp_path):
    """W=4 as 2 nodes x 2 tasks through submitit: ranks on both namespaces, GPT trained with FSDP (through
    adapters) equals one process within 1e-5 (relative, in norm)."""
    require_two_nodes()
    from benchmarks import train_gpt

    raw = train_gpt.main(["--launcher", "slurm", "--slurm-nodes", "2", "--world-sizes", "4", "--timeout", "300",
                          "--slurm-time-min", "8", "--out", str(tmp_path), "--quiet"])
    ranks = raw["results"][0]["ranks"]
    assert sorted({r["host"] for r in ranks}) == list(NODES), [r["host"] for r in ranks]
    assert sorted(r["local_rank"] for r in ranks) == [0, 0, 1, 1]
    assert ranks[0]["max_rel_err"] <= 1e-5, (ranks[0]["worst_param"], ranks[0]["max_rel_err"])
    assert _train_table((tmp_path / "train.md").read_text())[0][:3] == ["4", "2", "fsdpn1, fsdpn2"]


def _why_torchrun_failed(output: str) -> str:
    """The lines that say why (a rank's own error comes long before torchrun's summary and its agents' 300 s exit
    barrier tracebacks, which fill the tail), then the tail."""
    telling = [line for line in output.splitlines()
               if re.search(r"error|terminate|abort|exception|traceback|signal", line, re.I)
               and "elastic/agent/server/api.py" not in line]
    return "\n".join(telling[:40]) + "\n---- tail ----\n" + output[-2000:]


@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(420)
def test_torchrun_across_the_two_namespaces(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint fsdpn1:PORT` in each namespace:
    one W=4 job whose ranks sit on both nodes and train like one process."""
    require_two_nodes()
    require_own_namespaces()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/slurm/torchrun_2nodes.sh"), "2", "benchmarks/train_gpt.py",
                           "--world-sizes", "4", "--out", str(tmp_path), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, _why_torchrun_failed(proc.stdout + proc.stderr)
    raw = json.loads((tmp_path / "train.json").read_text())
    ranks = raw["results"][0]["ranks"]
    assert raw["config"]["launcher"] == "torchrun"
    assert sorted({r["host"] for r in ranks}) == list(NODES)
    assert ranks[0]["max_rel_err"] <= 1e-5


# ---- the queue -----------------------------------------------------------------------------------------
@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(240)
def test_a_request_slurm_can_never_satisfy_fails_at_once_with_the_reason(tmp_path):
    """A sweep with one W the cluster can run and one it never can (more nodes than it has; a node feature nobody
    has): the impossible one fails at once with SLURM's own words and what the cluster offers, the possible one
    still runs and its table is written, the error names --collect, and --collect keeps SLURM's reason."""
    require_slurm()
    from benchmarks import cli, sweep

    n_nodes = len(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split())
    w = n_nodes + 1  # one task per node: W=1 runs (1 x 1), W = nodes + 1 never can
    out = tmp_path / "a"
    args = _args(out, "--slurm-tasks-per-node", "1", "--timeout", "200", "--world-sizes", "1", str(w))
    t0 = time.monotonic()
    done = sweep.run(args, "probe", "benchmarks.launch:probe", [("W1", 1, {}), (f"W{w}", w, {})])
    assert list(done) == ["W1"] and done["W1"][0]["world_size"] == 1
    (said,) = args.sweep_failures
    # SLURM's own words, which depend on its version and on when it looks: PartitionConfig or PartitionNodeLimit
    # (pending reasons), or sbatch's "node configuration is not available" / "Node count specification invalid"
    assert any(reason in said for reason in ("PartitionConfig", "PartitionNodeLimit",
                                             "node configuration is not available", "Node count")), said
    assert "Hint: this cluster offers" in said
    with pytest.raises(sweep.SweepFailed) as failed:
        sweep.finish(args, "probe", {"benchmark": "probe"}, "| rank |\n", None)
    assert "--collect" in str(failed.value) and f"W{w} (W={w})" in str(failed.value)
    table = (out / "probe.incomplete.md").read_text()
    assert table.startswith("Machine: 1 host(s)") and f"not measured, W{w} (W={w})" in table
    assert time.monotonic() - t0 < 200
    # --collect keeps the reason (it is in the sweep's manifest)
    again = cli.parse(_parser(), ["--collect", str(args.sweep_folder)], "probe")
    sweep.run(again, "probe", "benchmarks.launch:probe", [("W1", 1, {}), (f"W{w}", w, {})])
    assert [f.split(":")[0] for f in again.sweep_failures] == [f"W{w} (W={w})"]
    assert said.split("\n")[0] in again.sweep_failures[0]
    # a constraint nobody has: refused by sbatch, or pending with BadConstraints (then cancelled)
    args = _args(tmp_path / "b", "--slurm-constraint", "no-such-feature")
    assert sweep.run(args, "probe", "benchmarks.launch:probe", [("W2", 2, {})]) == {}
    assert "Invalid feature specification" in args.sweep_failures[0] or "BadConstraints" in args.sweep_failures[0]
    # nothing of ours is left in the queue
    mine = subprocess.run(["squeue", "-h", "-n", f"fsdp-probe-W{w},fsdp-probe-W2"], capture_output=True,
                          text=True).stdout
    assert mine.strip() == ""


def _blocker(flag: Path) -> str:
    """A job holding every node until ``flag`` exists; returns its id."""
    n_nodes = len(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split())
    from benchmarks.slurm_launch import owner

    out = subprocess.run(["sbatch", "--parsable", "--exclusive", f"--nodes={n_nodes}", "--job-name=fsdp-test-blocker",
                          f"--comment=fsdp-owner={owner()}",
                          f"--output={flag.parent}/blocker.out",
                          f"--wrap=while [ ! -e {flag} ]; do sleep 0.5; done"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out.split(";")[0]


def _state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(300)
def test_a_job_pending_longer_than_the_run_timeout_is_not_cancelled(tmp_path):
    """--timeout counts from when SLURM starts the job: a job kept PENDING (every node held by another job) for
    longer than --timeout is still waited for, runs once the nodes free up, and its results come back."""
    require_slurm()
    from benchmarks import sweep

    flag = tmp_path / "release"
    blocker = _blocker(flag)
    run_timeout = 45.0
    args = _args(tmp_path / "out", "--timeout", str(run_timeout), "--queue-timeout", "600")
    outcome: dict = {}

    def drive():
        try:
            outcome["done"] = sweep.run(args, "probe", "benchmarks.launch:probe", [("W2", 2, {})])
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    driver = threading.Thread(target=drive, daemon=True)
    try:
        while _state(blocker) != "RUNNING":
            time.sleep(0.5)
        driver.start()
        while not ((manifest := _manifest(tmp_path / "out", "probe")) and json.loads(manifest.read_text())["jobs"]):
            assert driver.is_alive(), outcome
            time.sleep(0.5)
        job = json.loads(manifest.read_text())["jobs"]["W2"]["job_id"]
        t_pending = time.monotonic()
        while time.monotonic() - t_pending < run_timeout + 10:  # pending for longer than the run timeout
            assert _state(job) == "PENDING", f"job {job} left PENDING while the nodes were held: {_state(job)!r}"
            assert driver.is_alive(), outcome
            time.sleep(1)
        flag.touch()  # the blocker ends, the nodes free up, the job runs
        driver.join(timeout=240)
    finally:
        flag.touch()
        subprocess.run(["scancel", blocker], capture_output=True)
    assert not driver.is_alive(), "the driver never returned"
    assert "error" not in outcome, outcome.get("error")
    ranks = outcome["done"]["W2"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]


@pytest.mark.slow  # minutes: SLURM jobs, torch start-up in every rank
@pytest.mark.timeout(420)
def test_killing_the_driver_mid_sweep_then_collect_gives_the_tables(tmp_path):
    """A W=2,4 sweep is submitted at once; the driver is killed before any job finished; `--collect` waits for the
    jobs, and writes a table with both W, and collecting again gives the same table byte for byte."""
    require_two_nodes()
    from benchmarks import train_gpt

    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks/train_gpt.py"), "--launcher", "slurm", "--slurm-nodes", "2",
           "--world-sizes", "2", "4", "--steps", "2", "--timeout", "300", "--out", str(out)]
    driver = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not ((manifest := _manifest(out, "train")) and len(json.loads(manifest.read_text())["jobs"]) == 2):
            assert driver.poll() is None, driver.stdout.read().decode()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and only it (its own session)
        driver.wait()
    assert not (out / "train.md").exists()
    jobs = json.loads(manifest.read_text())["jobs"]
    train_gpt.main(["--collect", str(out), "--quiet"])  # the newest sweep in <out>: the killed driver's
    md = (out / "train.md").read_text()
    rows = _train_table(md)
    assert [r[0] for r in rows] == ["2", "4"], md
    assert all(float(r[-1]) <= 1e-5 for r in rows), md
    train_gpt.main(["--collect", str(out / "train.sweep"), "--out", str(tmp_path / "again"), "--quiet"])
    assert not list(out.glob("train.sweep.*")), "the collected sweep did not become <out>/train.sweep"
    assert (tmp_path / "again" / "train.md").read_text() == md
    for rec in jobs.values():
        assert _state(rec["job_id"]) in ("", "COMPLETED", "COMPLETING")


# ---- run_all.py across two nodes ---------------------------------------------------------------------------
@pytest.mark.slow  # minutes: 3 SLURM jobs and a local run, torch start-up in every rank
@pytest.mark.timeout(900)
def test_run_all_on_two_nodes_equals_the_local_run(tmp_path):
    """The README's multi-node run_all (`--launcher slurm --slurm-nodes 2`) at the quick sizes: the one-process
    baselines run as one task on one node, the FSDP world sizes across both nodes, and the bytes per step and the
    memory table (model, parameter and optimizer bytes exactly; measured peaks, the median of 3 steps, within 10%:
    gloo's threads free finished collectives' buffers on their own schedule) equal the local run's."""
    require_two_nodes()
    from benchmarks import run_all

    local, slurm = tmp_path / "local", tmp_path / "slurm"
    # --repeat 3: the median of three measured steps (one step's peak moves with when gloo's threads free the
    # tensors of finished collectives: 9% between two single-step runs of FSDP2 here)
    run_all.main(["--quick", "--only", "memory", "comm", "--repeat", "3", "--out", str(local), "--quiet"])
    # memory's W=1 "one process" launch is the one-process baseline case (step and scaling make theirs through the
    # same sweep and job shape); step is left out to keep CI short
    run_all.main(["--quick", "--only", "memory", "comm", "--repeat", "3", "--launcher", "slurm",
                  "--slurm-nodes", "2", "--slurm-time-min", "8", "--timeout", "400", "--out", str(slurm), "--quiet"])
    assert (slurm / "summary.md").exists() and not list(slurm.glob("*.incomplete.*"))
    mem = {d: json.loads((d / "memory.json").read_text()) for d in (local, slurm)}
    assert "2 host(s) (fsdpn1, fsdpn2), 3 rank process(es)" in mem[slurm]["machine"], mem[slurm]["machine"]
    assert mem[slurm]["ranks_machines"]["W1"][0]["host"] in NODES  # the baseline: one task, on a node
    rows = {d: {(r["strategy"], r["world_size"]): r for r in mem[d]["results"]} for d in mem}
    assert set(rows[local]) == set(rows[slurm]) and ("one process", 1) in rows[slurm]
    for key, here in rows[local].items():
        there = rows[slurm][key]
        assert there["model"] == here["model"], key
        for part in ("params", "optim"):  # rank by rank: which rank is the worst is noise (close peaks)
            assert ([r[part] for r in there["breakdown_at_peak_per_rank"]]
                    == [r[part] for r in here["breakdown_at_peak_per_rank"]]), (key, part)
        assert there["peak_bytes"] == pytest.approx(here["peak_bytes"], rel=0.10), key
    comm = {d: json.loads((d / "comm.json").read_text())["bytes_per_step"] for d in (local, slurm)}
    assert [(r["strategy"], r["world_size"], r["total_bus_bytes"]) for r in comm[slurm]] == \
        [(r["strategy"], r["world_size"], r["total_bus_bytes"]) for r in comm[local]]


# ---- one cluster per caller --------------------------------------------------------------------------------
def _sleeper(owner: str, tmp: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", "--job-name=fsdp-test-owner", f"--comment=fsdp-owner={owner}",
                          f"--output={tmp}/sleeper-%j.out", "--wrap=sleep 300"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out.split(";")[0]


@pytest.mark.slow  # seconds: two sbatch jobs and the scripts' own checks
@pytest.mark.timeout(180)
def test_two_callers_cannot_cancel_each_others_jobs(tmp_path):
    """A second caller's slurm_up.sh refuses the running cluster (status 4, naming whose it is) unless it asks to
    share it; sharing, its slurm_down.sh cancels only its own job and leaves the daemons to the first caller."""
    require_slurm()
    if os.geteuid() != 0:
        pytest.skip("slurm_up.sh runs as root")
    from benchmarks.slurm_launch import owner

    owners = Path(os.environ.get("FSDP_SLURM_ROOT", "/var/spool/fsdp-slurm")) / "owners"
    if not owners.exists() or owner() not in owners.read_text().split("\n"):
        pytest.skip(f"the running cluster was not started by this checkout ({owner()}); its owners: "
                    f"{owners.read_text().split() if owners.exists() else 'unknown'}")
    nodes = ["--nodes", "2"] if len(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                                                   text=True).stdout.split()) == 2 else []
    other = {**os.environ, "FSDP_SLURM_OWNER": f"another-caller-{os.getpid()}"}
    up = [str(ROOT / "benchmarks/slurm/slurm_up.sh"), *nodes]
    down = [str(ROOT / "benchmarks/slurm/slurm_down.sh")]
    refused = subprocess.run(["bash", *up], env=other, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 4, refused.stderr[-2000:]
    assert "started by another caller" in refused.stderr and owner() in refused.stderr
    ours = theirs = None
    try:
        joined = subprocess.run(["bash", *up], env={**other, "FSDP_SLURM_SHARE": "1"}, capture_output=True,
                                text=True, timeout=120)
        assert joined.returncode == 0, joined.stderr[-2000:]
        ours, theirs = _sleeper(owner(), tmp_path), _sleeper(other["FSDP_SLURM_OWNER"], tmp_path)
        stopped = subprocess.run(["bash", *down], env=other, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        assert "daemons left running" in stopped.stderr, stopped.stderr
        assert _state(theirs) in ("", "CANCELLED", "COMPLETING")
        assert _state(ours) in ("PENDING", "RUNNING", "CONFIGURING"), _state(ours)
        assert "UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout
        assert other["FSDP_SLURM_OWNER"] not in owners.read_text()
    finally:
        for job in (ours, theirs):
            if job:
                subprocess.run(["scancel", job], capture_output=True)
        text = owners.read_text() if owners.exists() else ""
        if other["FSDP_SLURM_OWNER"] in text:  # the test failed before its caller left: take it off the list
            owners.write_text("".join(f"{o}\n" for o in text.split() if o != other["FSDP_SLURM_OWNER"]))
