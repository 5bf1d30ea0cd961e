"""Task 6 (a student's): an explicit schedule of gathers and reductions, with its own log of what was issued."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

_logger = logging.getLogger(__name__)
_local = threading.local()


class Issued(NamedTuple):
    kind: str
    unit: int


@dataclasses.dataclass
class Pending:
    _handle: object = None
    _unit: int = -1
    _done: bool = False

    def wait(self) -> None:
        if self._handle is not None and not self._done:
            self._handle.wait()
            self._done = True


@dataclasses.dataclass
class Schedule:
    limit: int = 2
    _pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    _log: list = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def gather(self, unit: int, out: torch.Tensor, shard: torch.Tensor, group=None) -> Pending:
        with self._lock:
            while len(self._pending) >= self.limit:
                self._pending.popleft().wait()
            handle = dist.all_gather_into_tensor(out, shard, group=group, async_op=True)
            item = Pending(handle, unit)
            self._pending.append(item)
            self._log.append(Issued("all_gather", unit))
            _logger.debug("gather unit %d (%d in flight)", unit, len(self._pending))
            return item

    def reduce(self, unit: int, out: torch.Tensor, grad: torch.Tensor, group=None) -> Pending:
        handle = dist.reduce_scatter_tensor(out, grad, group=group, async_op=True)
        item = Pending(handle, unit)
        self._pending.append(item)
        self._log.append(Issued("reduce_scatter", unit))
        return item

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().wait()

    def issued(self) -> list[Issued]:
        return list(self._log)


def schedule() -> Schedule:
    if not hasattr(_local, "schedule"):
        _local.schedule = Schedule()
    return _local.schedule


def last_issued(s: Schedule) -> Issued | None:
    return s._log[-1] if s._log else None


def pending_units(s: Schedule) -> list[int]:
    return [p._unit for p in s._pending if not p._done]
