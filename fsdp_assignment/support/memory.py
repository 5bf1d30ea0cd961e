"""Live-tensor memory accounting that works on CPU (provided code, not a task).

On a GPU, ``torch.cuda.max_memory_allocated()`` answers "how much memory did this step need at its worst?". On
a CPU there is no such counter, so :class:`LiveStorageTracker` keeps one itself:

    from fsdp_assignment.support.memory import LiveStorageTracker

    with LiveStorageTracker() as mem:
        mem.track(model, label="params")          # storages that already existed count from here on
        mem.reset_peak()
        with mem.label("activations"):
            loss = model(x); loss.backward()
    print(mem.current_bytes, mem.peak_bytes, mem.peak_breakdown())

What it counts
--------------
* The bytes of every **storage** (``tensor.untyped_storage()``), not tensors: views share their base's storage,
  and a storage is counted once however many tensors look at it.
* A storage is counted from the moment the tracker first sees it: when an op run under the tracker returns it
  (a fresh allocation; or a view of an older tensor) or writes into it, when ``UntypedStorage.resize_`` is
  called on it, or when you pass it to :meth:`track`. Storages that existed before the tracker was entered
  and are only read are not counted; pass them to :meth:`track` if they should be.
* It stops counting a storage when the storage is freed (a finalizer on the storage object; PyTorch keeps
  one Python object per storage, so this fires when the last tensor using the storage dies).
* Size changes in place are followed: a storage may shrink to nothing and grow back while the same tensors keep
  pointing at it. ``UntypedStorage.resize_`` does not go through the dispatcher, so the
  tracker wraps it while active; for dispatched ops that write into their arguments (``aten.resize_``,
  ``aten.set_``, in-place ops, collectives) it re-reads the written storages' sizes after the op.
* Meta tensors hold no memory and are ignored. With ``device="cpu"`` (or ``"cuda"``...) only that device type
  counts; by default every real device is summed.

What it misses: memory allocated outside PyTorch tensors (the Python heap, the allocator's caching and
fragmentation, gloo's internal staging buffers on its worker threads) and temporaries created and freed
entirely inside one operator. So on a GPU the CUDA allocator's numbers are the ones to report; on a CPU this is
the closest honest equivalent, and it is what PyTorch's own ``torch.distributed._tools.mem_tracker`` does too.

Labels
------
Every counted storage carries a label (``"other"`` unless set) so the peak can be broken down. New storages take
the label of the innermost ``with tracker.label(...)``; :meth:`track` / :meth:`relabel` set it afterwards (for
example mark the optimizer state as ``"optim"`` once it exists). Storages resized through
``UntypedStorage.resize_`` take ``resize_label`` when one is given (FSDP's unsharded buffers).

:meth:`peak_breakdown` resolves labels when it is called, not when the peak happened, so a gradient that was
allocated under ``label("activations")`` during backward and relabelled ``"grads"`` after backward counts as
``"grads"`` in the breakdown of a peak that happened during backward. The tracker snapshots the live storages at
each new peak (lazily: at the first decrease after it), which is cheap because memory only peaks a few times.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import defaultdict, deque
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveStorageTracker", "storages_of", "format_bytes"]


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as the tables in the writeup use)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def storages_of(obj: Any) -> list[torch.UntypedStorage]:
    """Every untyped storage under ``obj``: a tensor (tensor subclasses such as DTensor are unwrapped to their
    inner tensors), an ``nn.Module`` (its parameters, their ``.grad`` not included, and buffers), an optimizer
    (its state), or any nesting of lists/tuples/dicts of those."""
    if isinstance(obj, nn.Module):
        obj = [list(obj.parameters()), list(obj.buffers())]
    elif isinstance(obj, torch.optim.Optimizer):
        obj = list(obj.state.values())
    out, seen = [], set()
    stack = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            stack.extend(getattr(t, a) for a in attrs if isinstance(getattr(t, a), torch.Tensor))
            continue
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            out.append(st)
    return out


class _Record:
    """What the tracker knows about one live storage. Kept alive by peak snapshots after the storage dies."""

    __slots__ = ("nbytes", "label", "serial")

    def __init__(self, nbytes: int, label: str, serial: int):
        self.nbytes, self.label, self.serial = nbytes, label, serial


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages; see the module docstring for exactly what is counted.

    Args:
        device: only count storages on this device type (``"cpu"``, ``"cuda"``); None counts every real device.
        default_label: label of new storages outside any ``with tracker.label(...)``.
        resize_label: if given, storages resized through ``UntypedStorage.resize_`` are relabelled to it.
    """

    def __init__(self, device: str | None = None, default_label: str = "other", resize_label: str | None = None):
        super().__init__()
        self.device_type = torch.device(device).type if device is not None else None
        self.resize_label = resize_label
        self._labels = [default_label]
        self._records: dict[int, tuple[_Record, weakref.finalize]] = {}  # id(storage) -> record
        self._serial = itertools.count()
        self._current = 0
        self._by_label: dict[str, int] = defaultdict(int)
        self._peak = 0
        self._peak_snapshot: list[tuple[_Record, int]] = []
        self._peak_dirty = False  # a new peak was reached and not yet snapshotted
        # Finalizers can run at awkward moments (inside our own bookkeeping, through the cyclic GC, on another
        # thread), so they only queue the record; every public entry point drains the queue first.
        self._dead: deque[int] = deque()
        self._lock = threading.RLock()
        self._orig_resize = None

    # ---- public API ---------------------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        """Bytes of the counted storages alive now."""
        self._drain()
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since the tracker started or since the last :meth:`reset_peak`."""
        self._drain()
        return self._peak

    def reset_peak(self) -> None:
        """Make the peak the current value (call after setup, before the part you want to measure)."""
        with self._lock:
            self._drain()
            self._peak = self._current
            self._snapshot()

    def bytes_by_label(self) -> dict[str, int]:
        """Current bytes per label (labels with nothing alive are left out)."""
        self._drain()
        return {k: v for k, v in self._by_label.items() if v}

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per label of the storages that were alive at the peak, labels as they are now."""
        with self._lock:
            self._drain()
            if self._peak_dirty:
                self._snapshot()
            out: dict[str, int] = defaultdict(int)
            for rec, nbytes in self._peak_snapshot:
                out[rec.label] += nbytes
            return {k: v for k, v in out.items() if v}

    @contextlib.contextmanager
    def label(self, name: str):
        """Storages first seen inside this block get label ``name``."""
        self._labels.append(name)
        try:
            yield self
        finally:
            self._labels.pop()

    def track(self, obj: Any, label: str | None = None) -> int:
        """Count the storages under ``obj`` (see :func:`storages_of`) from now on; returns their bytes.
        With ``label``, (re)label them, whether they were already counted or not."""
        with self._lock:
            self._drain()
            total = 0
            for st in storages_of(obj):
                rec = self._observe(st, label=label)
                total += rec.nbytes if rec is not None else 0
            return total

    relabel = track  # same thing; reads better when the storages are already counted

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _counts(self, st: torch.UntypedStorage) -> bool:
        dev = st.device.type
        return dev != "meta" and (self.device_type is None or dev == self.device_type)

    def _observe(self, st: torch.UntypedStorage, label: str | None = None) -> _Record | None:
        """Start counting ``st`` if new, otherwise re-read its size; (re)label it if ``label`` is given."""
        if not self._counts(st):
            return None
        key = id(st)
        entry = self._records.get(key)
        nbytes = st.nbytes()
        if entry is None:
            rec = _Record(0, label or self._labels[-1], next(self._serial))
            # The finalizer must not reference `st` (that would keep it alive) nor `self` strongly.
            fin = weakref.finalize(st, LiveStorageTracker._on_free, weakref.ref(self), key)
            fin.atexit = False
            self._records[key] = (rec, fin)
            self._change(rec, nbytes)
            return rec
        rec = entry[0]
        if label is not None and label != rec.label:
            self._by_label[rec.label] -= rec.nbytes
            rec.label = label
            self._by_label[label] += rec.nbytes
        if nbytes != rec.nbytes:
            self._change(rec, nbytes - rec.nbytes)
        return rec

    def _change(self, rec: _Record, delta: int) -> None:
        if delta < 0 and self._peak_dirty:
            self._snapshot()  # memory is about to fall from a new high: remember what made it up
        rec.nbytes += delta
        self._current += delta
        self._by_label[rec.label] += delta
        if self._current > self._peak:
            self._peak = self._current
            self._peak_dirty = True

    def _snapshot(self) -> None:
        self._peak_snapshot = [(rec, rec.nbytes) for rec, _ in self._records.values() if rec.nbytes]
        self._peak_dirty = False

    @staticmethod
    def _on_free(tracker_ref: weakref.ref, key: int) -> None:
        tracker = tracker_ref()
        if tracker is not None:
            tracker._dead.append(key)

    def _drain(self) -> None:
        while self._dead:
            key = self._dead.popleft()
            entry = self._records.get(key)
            if entry is not None:
                rec = entry[0]
                if rec.nbytes:
                    self._change(rec, -rec.nbytes)  # before the pop: a peak snapshot must still see it
                del self._records[key]

    # ---- hooks into PyTorch -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with self._lock:
            self._drain()  # frees that happened before/inside this op come before its new allocations
            touched = list(tree_leaves(out))
            if func._schema.is_mutable:  # in-place ops, resize_/set_, collectives writing their outputs
                for i, arg in enumerate(func._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        val = kwargs.get(arg.name, args[i] if i < len(args) else None)
                        touched.extend(tree_leaves(val))
            for t in touched:
                if type(t) is torch.Tensor or type(t) is nn.Parameter:  # the common case, without storages_of
                    if t.device.type != "meta":
                        self._observe(t.untyped_storage())
                elif isinstance(t, torch.Tensor):  # tensor subclasses (DTensor, ...): their inner tensors
                    for st in storages_of(t):
                        self._observe(st)
        return out

    def __enter__(self):
        tracker = self
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig

        # UntypedStorage.resize_ is a method of a Python class wrapping C++; it never reaches __torch_dispatch__.
        def resize_(st, size):
            result = orig(st, size)
            with tracker._lock:
                tracker._drain()
                tracker._observe(st, label=tracker.resize_label)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._drain()
