"""Every number the key quotes, computed from a results folder: ``values(results)`` returns a ``Values``, per
question the (name, what it is, value as printed) triples NUMBERS.md lists and key_source.md's ``{{name}}``
placeholders take, and the conclusions the questions' rules give on them (what ``--from`` prints).

The numbers themselves are computed by topic: values_memory.py (Q2, Q5, Q6, Q9, Q12, Q13's memory),
values_timing.py (Q10, Q11, Q13 (b)), values_scaling.py (Q14), scenario.py (Q15). The order of the calls below is
the order NUMBERS.md prints the questions in.
"""

from __future__ import annotations

from pathlib import Path

from staff.answer_key.benchmark_run import load
from staff.answer_key.scenario import add_scenario
from staff.answer_key.values_memory import add_norm_bytes, add_padding, add_peaks
from staff.answer_key.values_scaling import add_crossover
from staff.answer_key.values_timing import add_fits, add_steps


class Values:
    """What the key quotes: per question, (name, what it is, the value as printed)."""

    def __init__(self):
        self.by_q: dict[str, list[tuple[str, str, str]]] = {}
        self.conclusions: dict[str, list[tuple[str, str]]] = {}

    def add(self, q: str, name: str, what: str, value) -> None:
        self.by_q.setdefault(q, []).append((name, what, str(value)))

    def conclude(self, q: str, name: str, part: str, text: str) -> None:
        """The conclusion the question's rule gives on these numbers (also a value the key can quote)."""
        self.conclusions.setdefault(q, []).append((part, text))
        self.add(q, name, f"expected conclusion, {part}", text)

    def flat(self) -> dict[str, str]:
        return {name: value for items in self.by_q.values() for name, _, value in items}


def values(results: Path) -> Values:
    """Every number the key quotes, computed from the results folder (and Q15's scenario)."""
    v = Values()
    mem, comm, step, scaling = (load(results, n) for n in ("memory", "comm", "step", "scaling"))
    gpt = (mem.get("config") or {}).get("gpt") or (comm.get("config") or {}).get("gpt") \
        or (step.get("config") or {}).get("gpt")
    rows = {(r.get("strategy"), r.get("world_size")): r for r in mem.get("results") or []}

    add_padding(v, rows)            # Q2, Q12's levels
    add_norm_bytes(v)               # Q5
    add_peaks(v, mem, rows)         # Q6, Q9, Q13's memory
    add_fits(v, comm, gpt)          # Q10
    add_steps(v, step)              # Q11, Q13 (b)
    add_crossover(v, scaling, comm, gpt)  # Q14
    add_scenario(v)                 # Q15
    return v
