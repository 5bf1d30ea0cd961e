"""The key's scaling numbers (Q14): weak-scaling efficiency, the crossover W* with its range over the W = 2 fit's
± 2 SE, and writeup v5's (b): W = 2 against W*'s range, and the efficiency the model predicts at W = 2 against the
measured one. (The placeholders keep their v4 names, q14_c_conclusion and q14_d_conclusion: key_source.md quotes
them; both conclusions are part (b).)
"""

from __future__ import annotations

import math

from staff.answer_key.rules import _g, beta_range, crossover_w, fit_of, fit_usable, resolved

# Q14 (b)'s one name for a comparison these results cannot decide (no beta, no W*, or a model range open down to
# 0): the Models box's name for what a machine's fit cannot answer (issue 41: the tool used two names for it)
UNDECIDED = "undecided on this machine"
HALF = (f"say so: full marks; an answer that concludes they agree or do not agree without saying the comparison is "
        f"{UNDECIDED} earns half")


def efficiency_verdict(m: dict, point: float, b_lo: float, e_lo: float, e_hi: float) -> str:
    """Q14 (b)'s efficiency: the model's efficiency at W = 2 (perfect overlap, over the fit's ± 2 SE: e_lo to e_hi)
    against the measured weak-scaling row ``m``. Undecided on this machine, whatever was measured, when there is no
    W* (point infinite: alpha not resolved and c <= T_comp) and when beta - 2 SE <= 0 (the template's rule: the
    model's range then runs down to 0 and cannot disagree; issue 41: the tool said "they agree" there, and still
    said "they do not agree" when the measured low end was above the model's top)."""
    m_lo, m_hi = m.get("efficiency_range") or (m["efficiency"], m["efficiency"])
    measured = f"measured {m['efficiency']:.2f} ({m_lo:.2f} to {m_hi:.2f})"
    if not math.isfinite(point):  # the template's rule: with no W*, the comparison is undecided
        return (f"{UNDECIDED}: there is no W* (alpha not resolved, so alpha = 0, and c <= T_comp); {measured}: "
                + HALF)
    model = f"the model predicts an efficiency of {e_lo:.2f} to {e_hi:.2f} (perfect overlap, the fit's ± 2 SE)"
    if b_lo <= 0:
        return (f"{model}; {measured}: {UNDECIDED}: beta - 2 SE <= 0, so the model's range runs down to "
                f"{e_lo:.2f} and cannot disagree, whatever was measured; " + HALF)
    apart = ("they do not agree (the ranges are apart): the answer names what else limits the step (cores shared by "
             "the ranks, latency, overlap that is not perfect)")
    agree = m_hi >= e_lo and m_lo <= e_hi
    return f"{model}; {measured}: " + ("they agree (the ranges overlap)" if agree else apart)


def add_crossover(v, scaling: dict, comm: dict, gpt: dict | None) -> None:
    """Q14's values and its (b) conclusions (W = 2 against W*, and the efficiency)."""
    # Q14: W*, its range over the fit's ± 2 SE, and the efficiency the model predicts at W = 2
    base = next((r for r in scaling.get("results") or [] if r.get("scaling") == "weak" and r.get("strategy") == "FSDP"
                 and r.get("world_size") == 1), None)
    weak = {r["world_size"]: r for r in scaling.get("results") or [] if r.get("scaling") == "weak" and r.get("strategy") == "FSDP"}
    v.add("Q14", "q14_weak_eff", "weak-scaling FSDP efficiency at W = 2, 4 (min-max over the slowest rank's steps)",
          ", ".join(f"W = {w}: {_g(weak[w].get('efficiency'))}" + (
              f" ({_g(weak[w]['efficiency_range'][0])} to {_g(weak[w]['efficiency_range'][1])})"
              if weak[w].get("efficiency_range") else "") for w in (2, 4) if w in weak) or "n/a")
    f = fit_of(comm, 2)
    if base and f and gpt:
        units, t_comp, psi_s = gpt["n_layer"] + 1, base["step_s"], base["psi_params"]
        alpha, beta = fit_usable(f)
        if beta is None:
            v.add("Q14", "q14_wstar", "W*", "n/a: beta n/a (the W = 2 fit's slope is <= 0)")
            v.conclude("Q14", "q14_c_conclusion", "(b) W = 2 against W*",
                       "no W*: the fit has no beta (slope <= 0); say so: full marks")
            v.conclude("Q14", "q14_d_conclusion", "(b) the efficiency at W = 2",
                       f"{UNDECIDED}: no W* to compare with; say so")
        else:
            a_lo, a_hi = ((max(alpha - 2 * f["alpha_se_s"], 0.0), alpha + 2 * f["alpha_se_s"]) if alpha is not None
                          else (0.0, max(f["alpha_bound_s"], 0.0)))
            b_lo, b_hi = beta_range(f, beta)

            def w_star(al, be):  # None: communication never limits
                ws = crossover_w(al, be, t_comp, psi_s, units)
                return math.inf if ws is None else ws

            def eff2(al, be):  # the model's weak-scaling efficiency at W = 2 under perfect overlap
                if be <= 0:
                    return 0.0
                t_comm = (3 * units * al + 3 * psi_s * 4 / be / 2)
                return t_comp / max(t_comp, t_comm)

            point = w_star(alpha or 0.0, beta)
            lo, hi = w_star(a_hi, b_lo), w_star(a_lo, b_hi)
            rule = "" if alpha else (f" (alpha {f['alpha_s'] * 1e6:.0f} us not resolved{' and <= 0' if f['alpha_s'] <= 0 else ''}: "
                                     "alpha = 0 for the value, alpha_bound for the range: the Models box's rule)")
            v.add("Q14", "q14_wstar", "a, c, T_comp, W* and its range over the fit's ± 2 SE, from the W = 2 all-gather fit",
                  f"n_units = {units}, a = {3 * units * (alpha or 0.0) * 1e3:.2f} ms{rule}, c = "
                  f"{3 * psi_s * 4 / beta * 1e3:.0f} ms, T_comp = {t_comp * 1e3:.0f} ms, W* = "
                  + (f"{point:.2f}" if math.isfinite(point) else "none (c <= T_comp: communication never limits)")
                  + f", range {lo:.2f} to " + (f"{hi:.2f}" if math.isfinite(hi) else "none (never)")
                  + (" (beta - 2 SE <= 0: the range's low end is W = 1, communication could limit from the first "
                     "extra rank: say so)" if b_lo <= 0 else ""))
            v.conclude("Q14", "q14_c_conclusion", "(b) W = 2 against W*",
                       resolved(lo, hi, 2.0, below="W* below 2: communication limits the step at W = 2",
                                above="W* above 2: compute limits the step at W = 2", point=point,
                                sides=("communication-limited", "compute-limited")))
            e_lo, e_hi = eff2(a_hi, b_lo), eff2(a_lo, b_hi)
            m = weak.get(2)
            if m:
                v.conclude("Q14", "q14_d_conclusion", "(b) the efficiency at W = 2",
                           efficiency_verdict(m, point, b_lo, e_lo, e_hi))
    else:
        v.add("Q14", "q14_wstar", "W*", "n/a (scaling.json or comm.json missing)")
        v.conclude("Q14", "q14_c_conclusion", "(b)", "not answerable from these results (no W = 2 fit or no scaling)")
