"""The machine a rank ran on: host, CPU model and cores, GPU model and count, torch/CUDA/NCCL versions, and the
interconnect where it can be read. Every rank reports its own (``describe``, called by launch.run_rank), so a
cluster run records the compute nodes, not the login node the driver ran on; ``summary`` makes the one line every
table starts with."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cores() -> int:
    try:  # what this process may use (a SLURM task is often given fewer cores than the node has)
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _interconnect() -> list[str]:
    """Network devices this node has: InfiniBand/RoCE adapters (with their link rate) and NICs that are up."""
    found = []
    ib = Path("/sys/class/infiniband")
    if ib.is_dir():
        for dev in sorted(ib.iterdir()):
            rates = sorted({p.read_text().strip() for p in dev.glob("ports/*/rate") if p.is_file()})
            found.append(f"{dev.name} ({', '.join(rates) or 'rate unknown'})")
    net = Path("/sys/class/net")
    if net.is_dir():
        for dev in sorted(net.iterdir()):
            if dev.name == "lo":
                continue
            try:
                if (dev / "operstate").read_text().strip() != "up":
                    continue
                speed = (dev / "speed").read_text().strip()
            except OSError:
                speed = ""
            found.append(f"{dev.name}" + (f" {speed} Mb/s" if speed and speed != "-1" else ""))
    return found


def describe(device) -> dict:
    """This rank's machine (``device``: the torch.device it computes on)."""
    import torch

    info = {"host": socket.gethostname(), "cpu": _cpu_model(), "cores": _cores(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": None, "gpus": 0, "gpu": None, "device": str(device),
            "interconnect": _interconnect()}
    if torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(device if device.type == "cuda" else 0)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
    return info


def summary(machines: list[dict]) -> str:
    """One line for the top of a table, from every rank's ``describe`` (the same values are named once)."""
    if not machines:
        return "Machine: not recorded (no rank finished)."
    hosts = sorted({m["host"] for m in machines})

    def one(key: str) -> str:
        vals = list(dict.fromkeys(str(m.get(key)) for m in machines))
        return vals[0] if len(vals) == 1 else " / ".join(vals)

    gpus = "no GPU" if not any(m.get("gpus") for m in machines) else f"GPU {one('gpu')} ({one('gpus')} per node)"
    nets = list(dict.fromkeys(n for m in machines for n in m.get("interconnect", [])))
    # The ranks of every launch of the table (W = 1, 2, 4 are separate launches): a count of processes, not of
    # the machine's size, so it comes after the hosts.
    return (f"Machine: {len(hosts)} host(s) ({', '.join(hosts)}), {len(machines)} rank process(es) over the "
            f"table's launches; CPU {one('cpu')}, "
            f"{one('cores')} usable cores per process; {gpus}; torch {one('torch')}, CUDA {one('cuda')}, "
            f"NCCL {one('nccl')}; network: {', '.join(nets) or 'not readable'}.")
