"""The Models box's rules, as functions of one fit or one interval (no results folder): the noise rule
(``resolved``), which alpha and beta a fit lets the student use, beta's ± 2 SE range, N_1/2's range and Q10 (b)'s
verdict on it, the crossover W*, which rows are the student's own FSDP, and the memory model's dominant term.
The number formats the key prints (``_mib``, ``_g``) live here too: every values module uses them.
"""

from __future__ import annotations

import math

MIB = 2**20


def _mib(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x / MIB:.{digits}g} MiB"


def _g(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def resolved(lo: float, hi: float, threshold: float = 1.0, below: str = "faster", above: str = "slower",
             point: float | None = None, sides: tuple[str, str] | None = None) -> str:
    """The handout's noise rule (Models box, item 4): resolved only when the whole interval is on one side of the
    threshold; otherwise undecided at this precision, and the answer gives the interval and the side of the point
    estimate (that answer earns the part). ``sides``: the short names of the two sides ("the faster side"), when
    ``below``/``above`` are sentences; by default they are ``below`` and ``above``."""
    if hi < threshold:
        return f"resolved: {below}"
    if lo > threshold:
        return f"resolved: {above}"
    low_side, high_side = sides or (below, above)
    side = "" if point is None else (f"; the point estimate is on the {low_side} side" if point < threshold else
                                     f"; the point estimate is on the {high_side} side" if point > threshold else
                                     "; the point estimate is on the threshold")
    return f"undecided at this precision (the interval contains {threshold:g}){side}: say so, with the interval"


def fit_usable(f: dict) -> tuple[float | None, float | None]:
    """(alpha to use, beta) of a fit under the Models box's rule: alpha only when resolved and > 0 (else None: use 0,
    and alpha_bound as an upper bound); beta only when the fitted slope is > 0 (else None: no beta, no N_1/2, no W*)."""
    beta = f.get("beta_bytes_per_s")
    beta = beta if isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0 else None
    alpha = f["alpha_s"] if f.get("alpha_resolved") and f.get("alpha_s", 0) > 0 else None
    return alpha, beta


def beta_range(f: dict, beta: float) -> tuple[float, float]:
    """beta's +- 2 SE interval (its lower end may be <= 0: then beta is bounded below by nothing)."""
    rel = f.get("beta_rel_se")
    rel = rel if isinstance(rel, (int, float)) and math.isfinite(rel) else math.inf
    return beta * (1 - 2 * rel), beta * (1 + 2 * rel)


def fit_of(comm: dict, w: int, kind: str = "all_gather") -> dict | None:
    """The script's own fit (bench_comm.py's alpha_beta records) for ``kind`` at W = w, on the real interconnect."""
    return next((f for f in comm.get("alpha_beta") or [] if f.get("kind") == kind and f.get("world_size") == w
                 and str(f.get("interconnect", "gloo")).startswith(("gloo", "nccl"))), None)


def crossover_w(alpha: float, beta: float, t_comp: float, psi: int, units: int, b: int = 4) -> float | None:
    """The Models box's W*: the positive root of a W^2 + (c - a - T) W - c = 0, a = 3 n_units alpha, c = 3 psi b /
    beta; with alpha <= 0 (the rule for an unresolved alpha: 0) W* = c / (c - T) if c > T, else None (never)."""
    if beta <= 0:  # no bandwidth bound: communication could limit from the first extra rank on
        return 1.0
    a, c, t = 3 * units * alpha, 3 * psi * b / beta, t_comp
    if a <= 0:
        return c / (c - t) if c > t else None
    return ((t + a - c) + ((t + a - c) ** 2 + 4 * a * c) ** 0.5) / (2 * a)


def n_half_interval(f: dict, w: int, b: int = 4) -> tuple[float, float]:
    """N_1/2 = W alpha beta / b over the fit's ± 2 SE ranges of alpha and beta: (lowest, highest), in elements.
    alpha unresolved or <= 0: (0, W alpha_bound (beta + 2 SE) / b), an upper bound only (the Models box's rule; with
    the point beta it would not bound N_1/2); beta - 2 SE <= 0: the lowest is 0 (no lower bound); beta n/a
    (slope <= 0): (nan, nan)."""
    alpha, beta = fit_usable(f)
    if beta is None:
        return math.nan, math.nan
    b_lo, b_hi = beta_range(f, beta)
    if alpha is None:
        return 0.0, w * f["alpha_bound_s"] * b_hi / b
    a_lo, a_hi = max(alpha - 2 * f["alpha_se_s"], 0.0), alpha + 2 * f["alpha_se_s"]
    return w * a_lo * max(b_lo, 0.0) / b, w * a_hi * b_hi / b


def latency_or_bandwidth(blk: int, interval: tuple[float, float], alpha, beta, w: int) -> str:
    """Q10 (b)'s rule: Psi_blk against N_1/2's range (an unresolved alpha gives only an upper bound; no beta, no
    N_1/2)."""
    lo, hi = interval
    if beta is None:
        return "undecided on this machine: no beta (the fit's slope <= 0), so no N_1/2: say so"
    if blk > hi:
        return ("bandwidth-bound: Psi_blk is above " + ("the bound on N_1/2" if alpha is None else "N_1/2's whole range"))
    if alpha is not None and blk < lo:
        return "latency-bound: Psi_blk is below N_1/2's whole range"
    if alpha is None:
        return ("undecided at this precision: alpha is not resolved, so N_1/2 has only an upper bound, and Psi_blk is "
                "below it: say so")
    point = w * alpha * beta / 4
    return (f"undecided at this precision: Psi_blk is inside N_1/2's range ({lo:,.0f} to {hi:,.0f}); the point estimate "
            f"N_1/2 = {point:,.0f} puts it on the {'bandwidth' if blk > point else 'latency'}-bound side: say so, "
            "with the range")


def students_row(strategy: str) -> bool:
    """A row of the student's own FSDP (FSDP, no-reshard, + prefetch, 2 blocks/unit), not torch's FSDP2."""
    return strategy.startswith("FSDP") and "FSDP2" not in strategy


def dominant_term(model: dict) -> tuple[str, str, dict[str, int]]:
    """(the largest term, its branch, that branch's terms) of the Models box's memory model,
    max(12 S + A + 4 (U_p + U_g), 16 S + 4 U_end): the dominant term is read in the branch that sets the peak, never
    across the two (16 S and 4 U_end belong to the end of backward, 12 S, A and 4 (U_p + U_g) to its start)."""
    start = {"12 S (parameters + AdamW)": 12 * model["S"], "A (activations)": model["activations_bytes"],
             "4 (U_p + U_g) (unsharded)": model["unsharded_params_bytes"] + model["unsharded_grads_bytes"]}
    end = {"16 S (model states)": 16 * model["S"], "4 U_end": model["end_extra_bytes"]}
    branch, terms = (("start-of-backward", start) if model["at_backward_start"] >= model["at_backward_end"]
                     else ("end-of-backward", end))
    return max(terms, key=terms.get), branch, terms

