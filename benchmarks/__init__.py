"""Benchmarks that fill the writeup: memory, communication, step time, scaling (see benchmarks/README.md).

Layers (each imports only those below it; tests/test_benchmarks.py checks it):

    run_all.py, bench_*.py, gpt2_small.py, train_gpt.py   the scripts: flags, tables, plots
    cli.py                                                the shared flags, checked before torch is imported
    sweep.py, slurm_launch.py                             running the launches of a sweep (local/torchrun/SLURM)
    launch.py, measure.py, trace.py, trainers.py,         what runs inside the ranks
    comm_meter.py
    report.py, machine.py                                 progress lines, outputs, statistics, the machine

Nothing a script imports at its top imports torch: a bad flag is answered in a fraction of a second, not after the
20-50 s that `import torch` takes on a loaded machine. What needs torch imports it where it is used, or through
``lazy_import`` below.
"""

import importlib
import types


class _LazyModule(types.ModuleType):
    """A stand-in for a module that is imported the first time one of its attributes is read."""

    def __init__(self, name: str):
        super().__init__(name)

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self.__name__), attr)


def lazy_import(name: str) -> types.ModuleType:
    """``torch = lazy_import("torch")``: module-level code may name torch, but torch is imported only when a
    function first uses it (inside the ranks, or after the flags were checked)."""
    return _LazyModule(name)
