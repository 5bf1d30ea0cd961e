"""A real SLURM round trip: submit a 2-rank benchmark through submitit and get its table back.

Needs a reachable SLURM cluster: `sudo bash benchmarks/slurm/slurm_up.sh` brings up a one-node cluster on this
machine (and `bash benchmarks/slurm/slurm_down.sh` stops it). Without one the test is skipped, and says why,
unless FSDP_REQUIRE_SLURM=1 (as in CI, which starts the cluster first): then a missing cluster is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

HEADER = "| collective | W | interconnect | size | time us | algbw GB/s | busbw GB/s |"


def _slurm_problem() -> str | None:
    """None when a SLURM controller answers and has a usable node; otherwise what is missing."""
    for tool in ("sbatch", "sinfo", "scontrol"):
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
                    f"Start it with `bash benchmarks/slurm/slurm_up.sh` (as root).", pytrace=False)
    pytest.skip(f"SLURM not reachable: {problem}. `sudo bash benchmarks/slurm/slurm_up.sh` starts a local "
                f"one-node cluster (FSDP_REQUIRE_SLURM=1 turns this skip into a failure)")


@pytest.mark.timeout(300)
def test_benchmark_through_submitit_returns_its_table(tmp_path):
    """bench_comm at a tiny size as one submitit job with tasks_per_node=2: the two SLURM tasks form a gloo
    process group (FileStore in the submitit folder), run the collectives and a counted DDP step, and their
    results come back to this process, which writes the same table as a local run."""
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
