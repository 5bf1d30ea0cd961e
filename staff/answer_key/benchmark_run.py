"""The staff's benchmark run: the machine it ran on, the fingerprint of the code that made the results, and the run
itself (``run_benchmarks``), which keeps the benchmarks' JSON and tables in a results folder with a run.json record.

regenerate.py calls it (see its docstring); the other modules only read what it kept (``load``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "staff" / "answer_key"


def machine() -> dict:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu": cpu, "cores": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "load_1min": round(load[0], 2)}


# The code that produces the results (the benchmark run); the key's modules (staff/answer_key/*.py) only derive
# from them, so editing those means re-deriving (--rederive), not re-running the benchmarks.
FINGERPRINTED = ("benchmarks/*.py", "fsdp_assignment/reference/*.py", "fsdp_assignment/support/*.py", "adapters.py")
RESULTS = HERE / "results"  # the staff run's results (JSON and tables), committed: NUMBERS.md and the key derive from it
KEPT = ("memory", "comm", "step", "scaling")
# run_all.py only routes flags and chains the four scripts: what it computes is theirs (and helper fixes to its
# --help must not make the committed results stale)
NOT_FINGERPRINTED = ("benchmarks/run_all.py",
                     # the students' tracer and its rooms: they make none of the results
                     "benchmarks/hook_trace.py", "benchmarks/hook_trace_probes.py", "benchmarks/hook_trace_report.py",
                     "benchmarks/hook_trace_scenarios.py")
WORLD_SIZES = (1, 2, 4)  # what the defaults run (memory and scaling; comm and step need W >= 2)


def _code_only(source: str) -> str:
    """The AST of ``source`` without docstrings: what the code computes, not how it is explained."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def sources_fingerprint(root: Path = ROOT) -> str:
    """SHA-256 over the code of the files that determine the numbers (see the module docstring)."""
    import hashlib

    h = hashlib.sha256()
    for pattern in FINGERPRINTED:
        for path in sorted(root.glob(pattern)):
            if path.relative_to(root).as_posix() in NOT_FINGERPRINTED:
                continue
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(_code_only(path.read_text(encoding="utf-8")).encode() + b"\0")
    return h.hexdigest()


def run_benchmarks(out: Path, full: bool) -> dict:
    """Run the reference's benchmarks into a temporary folder and keep their JSON and tables in ``out`` with a
    run.json record: machine, load before and after, command, seconds, the fingerprint of the code that made them."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="answer-key-"))
    cmd = [sys.executable, "benchmarks/run_all.py", "--out", str(tmp)] + ([] if full else ["--quick"])
    env = dict(os.environ, FSDP_IMPL="reference")
    fingerprint, before = sources_fingerprint(), machine()
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    seconds, after = time.monotonic() - t0, machine()
    if sources_fingerprint() != fingerprint:
        raise SystemExit("the benchmark or reference sources changed during the run: run again")
    src = tmp if full else tmp / "quick"
    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        for ext in ("json", "md"):
            if (src / f"{name}.{ext}").exists():
                shutil.copy(src / f"{name}.{ext}", out / f"{name}.{ext}")
    if (src / "step_timeline.png").exists():
        shutil.copy(src / "step_timeline.png", out / "step_timeline.png")
    record = {"command": "FSDP_IMPL=reference python benchmarks/run_all.py" + ("" if full else " --quick"),
              "seconds": round(seconds), "machine_before": before, "machine_after": after,
              "sources_sha256": fingerprint, "fingerprinted": list(FINGERPRINTED), "quick": not full}
    (out / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}

