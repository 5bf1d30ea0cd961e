"""Progress lines and outputs: what every benchmark prints and writes (JSON, markdown, PNG), and the statistics
its tables use (median with spread and count). Nothing here knows how the ranks were started."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `adapters` and `fsdp_assignment` live at the repo root
    sys.path.insert(0, str(ROOT))
# no torch here: the scripts check their flags before anything imports it (benchmarks/__init__.py)

DEFAULT_OUT = ROOT / "benchmarks" / "results"
MiB = 1024 * 1024
_T0 = time.time()  # progress lines count from the driver's start; the ranks get it through their settings
QUICK_NOTE = "**quick run (`--quick`): tiny sizes that check the plumbing; these numbers mean nothing.**\n\n"


def under_torchrun() -> bool:
    """True in a process that torchrun started (it sets these for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)
def log(msg: str, *, quiet: bool = False) -> None:
    """A progress line, flushed at once (runs take a while; show that they move)."""
    if not quiet and is_writer():
        print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def is_writer() -> bool:
    """Only one process writes outputs: the driver, or rank 0 under torchrun."""
    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, name: str, raw: dict, markdown: str, plot: Callable[[], Any] | None, *,
                  quiet: bool = False, quick: bool = False, suffix: str = "",
                  more_plots: dict[str, Callable[[], Any]] | None = None) -> dict:
    """<out>/<name><suffix>.json (everything measured, plus how), .md (the table, also printed), .png (the figure
    ``plot()`` returns). A ``quick`` run's table starts by saying so, and its JSON records it.

    Every file is written to a temporary name first and renamed only once all of them were made: a run that fails
    or is interrupted while writing (the plot raising, Ctrl-C) leaves the previous files as they were."""
    out_dir = Path(out_dir)
    if quick:
        markdown = QUICK_NOTE + markdown
        raw = {**raw, "quick": True}
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}{suffix}.json", "md": out_dir / f"{name}{suffix}.md"}
    if plot is not None:
        paths["png"] = out_dir / f"{name}{suffix}.png"
    figures = {"png": plot} if plot is not None else {}
    for key, more in (more_plots or {}).items():  # more figures: <name>_<key><suffix>.png
        paths[key] = out_dir / f"{name}_{key}{suffix}.png"
        figures[key] = more
    tmp = {k: v.with_name(f".{v.name}.{os.getpid()}.tmp") for k, v in paths.items()}
    try:
        tmp["json"].write_text(json.dumps(raw, indent=2, default=str) + "\n")
        tmp["md"].write_text(markdown)
        if figures:
            import matplotlib

            matplotlib.use("Agg")  # no display on clusters and CI
            import matplotlib.pyplot as plt

            for key, make in figures.items():
                fig = make()
                fig.savefig(tmp[key], dpi=110, format="png")
                plt.close(fig)
        for k in paths:
            tmp[k].replace(paths[k])
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    print(markdown)
    log("wrote " + ", ".join(str(v) for v in paths.values()), quiet=quiet)
    return {k: str(v) for k, v in paths.items()}


def environment() -> dict:
    """What the numbers depend on, stored in every JSON."""
    import platform

    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "cpus": os.cpu_count(), "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "fsdp_impl": adapters_implementation()}


def adapters_implementation() -> str:
    """Which implementation adapters.py forwards to (FSDP_IMPL, or its default)."""
    import adapters
    return adapters.implementation()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float], scale: float = 1.0) -> str:
    """'median (min-max, n=K)' of repeated measurements, each multiplied by ``scale``: the table cell for a
    number that was measured more than once, so a reader sees how much it moved."""
    if not xs:
        return "n/a"
    v = [x * scale for x in xs]

    def f(x: float) -> str:
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"

    if len(v) == 1:
        return f"{f(v[0])} (n=1)"
    return f"{f(statistics.median(v))} ({f(min(v))}-{f(max(v))}, n={len(v)})"
