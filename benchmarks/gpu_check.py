"""One command for a GPU machine: every part of the GPU path, in minutes, and one report.

    python benchmarks/gpu_check.py                         # on a machine with 1 or more NVIDIA GPUs, < 8 min on one
    python benchmarks/gpu_check.py --device cpu --dry-run  # anywhere (CI): builds the plan, checks every command's
                                                           # flags, collects the NCCL tests, runs the snapshot code
                                                           # on CPU; executes no GPU part

Parts (each with its own time limit; a part that fails is reported and the others still run):

    nccl tests   every test variant on the NCCL backend that fits the GPUs present (pytest -k nccl over the test
                 folders that exist here; the backend fixture skips variants that need more GPUs, and says so)
    memory       bench_memory.py --device cuda at W = 1 and W = number of GPUs: per-rank peak from
                 torch.cuda.max_memory_allocated next to the printed model
    step         bench_step.py --device cuda at W = number of GPUs, real NCCL only: step time of FSDP, FSDP + prefetch
                 and torch's FSDP2 on the same GPUs, their alternated ratios, exposed communication from the GPU
                 kernel timeline, the per-rank profiler traces and the timeline picture
    snapshot     a CUDA memory snapshot of three FSDP steps of the benchmark GPT (torch.cuda.memory.
                 _record_memory_history / _dump_snapshot): drag <out>/memory_snapshot.pickle into
                 https://pytorch.org/memory_viz

Output: <out>/gpu_check.md (the report: each part's status, time and tables), <out>/logs/<part>.log, and the
benchmarks' own files under <out>/bench/. Default <out>: benchmarks/results/gpu_check/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_memory, bench_step, cli  # noqa: E402  (none of these imports torch)

BUDGET_S = 8 * 60


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, without importing torch (nvidia-smi -L, else the driver's /proc entries)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        if n:
            return n
    except (OSError, subprocess.TimeoutExpired):
        pass
    return len(list(Path("/proc/driver/nvidia/gpus").glob("*")))


def plan(device: str, n: int, out: Path, dry_run: bool) -> list[dict]:
    """The parts: name, command, time limit (s), and for benchmarks the module whose flags the command must pass."""
    py = sys.executable
    bench = out / "bench"
    test_dirs = [d for d in ("tests/public", "tests/hidden") if (ROOT / d).is_dir()]
    sizes_mem = ["1"] + ([str(n)] if n > 1 else [])
    return [
        {"name": "nccl tests", "timeout": 240,
         "cmd": [py, "-m", "pytest", *test_dirs, "-k", "nccl", "-q", "-p", "no:cacheprovider", "-rs"]
         + (["--collect-only"] if dry_run else [])},
        {"name": "memory", "timeout": 120, "module": bench_memory,
         "cmd": [py, "benchmarks/bench_memory.py", "--device", device, "--world-sizes", *sizes_mem,
                 "--repeat", "2", "--out", str(bench)]},
        {"name": "step", "timeout": 150, "module": bench_step,
         "cmd": [py, "benchmarks/bench_step.py", "--device", device, "--world-sizes", str(n), "--sim-bandwidth",
                 "0", "--rounds", "5", "--out", str(bench)]},
        {"name": "snapshot", "timeout": 90,
         "cmd": [py, "benchmarks/gpu_check.py", "--snapshot", str(out / "memory_snapshot.pickle"), "--device", device]},
    ]


def snapshot(path: Path, device: str) -> dict:
    """Three AdamW steps of the benchmark GPT under FSDP (W=1) with CUDA's memory history recorded, dumped to
    ``path``. On a CPU the same steps run (so the code path is exercised) and no snapshot is written."""
    import tempfile

    import torch
    import torch.distributed as dist

    from benchmarks import trainers

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    # The store's file lives in a folder of our own that goes with the run (a FileStore of one rank leaves it).
    store_dir = tempfile.TemporaryDirectory(prefix="fsdp_snapshot_")
    store = dist.FileStore(str(Path(store_dir.name) / "store"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    try:
        size = ({"params": 4e6, "layers": 8, "block_size": 32, "vocab": 1021} if cuda else  # CPU: tiny, it only
                {"params": 2e5, "layers": 2, "block_size": 16, "vocab": 1021})               # checks the code path
        cfg = trainers.model_config(size)
        trainer = trainers.build_trainer("FSDP", cfg, 8 if cuda else 1, dev)
        trainer.step(0)  # warm-up: AdamW's state exists from here on
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        for _ in range(3):
            trainer.step(0)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            return {"snapshot": str(path), "bytes": path.stat().st_size,
                    "peak_MiB": torch.cuda.max_memory_allocated(dev) / 2 ** 20}
        return {"snapshot": None, "note": "CPU: 3 FSDP steps ran; CUDA memory history exists only on a GPU"}
    finally:
        dist.destroy_process_group()
        del store
        store_dir.cleanup()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true", help="check the plan and every command's flags; run no GPU part")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    p.add_argument("--snapshot", type=Path, default=None, help=argparse.SUPPRESS)  # the snapshot part's own process
    args = p.parse_args(argv)
    if args.snapshot is not None:
        print(json.dumps(snapshot(args.snapshot, args.device)), flush=True)
        os._exit(0)  # done: do not wait at interpreter exit for threads the process group left behind
    n = gpu_count()
    if args.device == "cuda" and n == 0:
        p.error("no NVIDIA GPU here (nvidia-smi -L, /proc/driver/nvidia/gpus); on a CPU machine use "
                "--device cpu --dry-run")
    n = max(n, 1) if args.device == "cuda" else 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    parts = plan(args.device, n, args.out, args.dry_run)
    for part in parts:  # every benchmark command's flags, before anything runs (torch-free)
        if "module" in part:
            mod = part["module"]
            cli.parse(mod.parser(), part["cmd"][2:], mod.NAME, mod.QUICK)
    t_all = time.perf_counter()
    report = [f"# GPU check ({'DRY RUN, ' if args.dry_run else ''}device {args.device}, {n} GPU(s) used)\n"]
    failed = []
    for part in parts:
        run = not args.dry_run or part["name"] in ("nccl tests", "snapshot")
        left = BUDGET_S - (time.perf_counter() - t_all)
        log = args.out / "logs" / f"{part['name'].replace(' ', '_')}.log"
        if not run:
            report.append(f"## {part['name']}: dry run, not executed (flags checked)\n\n    {' '.join(part['cmd'])}\n")
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(part["cmd"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(10, min(part["timeout"], left)))
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            said = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                           for x in (exc.stdout or "", exc.stderr or ""))
            rc, text = "timeout", f"{said}\nTIMED OUT after {exc.timeout:.0f} s"
        log.write_text(text)
        took = time.perf_counter() - t0
        ok = rc == 0
        if not ok:
            failed.append(part["name"])
        tail = "\n".join(text.strip().splitlines()[-6:])
        report.append(f"## {part['name']}: {'ok' if ok else f'FAILED ({rc})'} in {took:.0f} s\n\n"
                      f"    {' '.join(part['cmd'])}\n\nlast lines ({log}):\n\n```\n{tail}\n```\n")
        for name in ("memory", "step"):
            md = args.out / "bench" / f"{name}.md"
            if part["name"] == name and md.exists():
                report.append(f"### {name}.md\n\n{md.read_text()}\n")
    total = time.perf_counter() - t_all
    report.insert(1, f"Total {total:.0f} s (budget {BUDGET_S} s); "
                     f"{'all parts ok' if not failed else 'FAILED: ' + ', '.join(failed)}.\n")
    (args.out / "gpu_check.md").write_text("\n".join(report))
    print("\n".join(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
