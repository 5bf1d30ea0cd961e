"""The key's communication and step-time numbers: Q10 (the W = 2 all-gather fit, N_1/2, latency- or bandwidth-bound)
and Q11 and Q13 (b) (step ratios with the noise rule, exposed communication).

Each function adds its values to ``v`` (values.Values) in the order NUMBERS.md prints them.
"""

from __future__ import annotations

import statistics
import sys

from staff.answer_key.benchmark_run import ROOT
from staff.answer_key.rules import (_g, beta_range, fit_of, fit_usable, latency_or_bandwidth, n_half_interval,
                                    resolved)


def root_params(gpt: dict) -> tuple[int, int]:
    """(parameters of the root unit, all parameters) of the benchmark GPT: what no block owns (wte = the tied head,
    wpe, ln_f), counted on the meta device."""
    import torch

    sys.path.insert(0, str(ROOT))
    from fsdp_assignment.support.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**gpt))
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for p in model.blocks.parameters())
    return total - in_blocks, total



def add_fits(v, comm: dict, gpt: dict | None) -> None:
    """Q10: Psi_blk, the W = 2 all-gather fit with N_1/2's range, and (b)'s verdict on Psi_blk against it (writeup v5
    asks neither the W = 4 fit nor a comparison with the collectives table's bus bandwidth)."""
    # Q10: the script's fit at W = 2
    psi_root, psi = root_params(gpt) if gpt else (None, None)
    blk = (psi - psi_root) // gpt["n_layer"] if gpt else None
    v.add("Q10", "q10_blk", "Psi_blk (one block)", f"{blk:,} elements" if blk else "n/a")
    v.add("Q10", "q10_psi_per_layer", "Psi / n_layer, the root's embeddings counted in (not Psi_blk)",
          f"{psi // gpt['n_layer']:,} elements" if gpt else "n/a")
    W = 2
    f = fit_of(comm, W)
    if not f:
        v.add("Q10", f"q10_fit_w{W}", f"all-gather fit at W = {W}", "n/a (comm.json: no fit)")
        v.conclude("Q10", f"q10_c_w{W}", f"(b) at W = {W}", "no fit at this W: the part is not answerable")
        return
    alpha, beta = fit_usable(f)
    interval = n_half_interval(f, W)
    if beta is None:
        half = "no N_1/2: the fitted slope is <= 0 (beta n/a)"
    elif alpha is not None:
        half = (f"N_1/2 = W alpha beta / b = {W * alpha * beta / 4:,.0f} elements, ± 2 SE range "
                f"{interval[0]:,.0f} to {interval[1]:,.0f}"
                + (" (beta - 2 SE <= 0: the range has no lower bound, its lowest is 0: say so)"
                   if beta_range(f, beta)[0] <= 0 else ""))
    else:
        half = (f"alpha not resolved{' (<= 0)' if f['alpha_s'] <= 0 else ''}: N_1/2 < W alpha_bound "
                f"(beta + 2 SE) / b = {interval[1]:,.0f} elements (alpha_bound = "
                f"{f['alpha_bound_s'] * 1e6:.0f} us), no lower bound")
    v.add("Q10", f"q10_fit_w{W}", f"all-gather fit at W = {W}",
          f"alpha = {f['alpha_s'] * 1e6:.0f} ± {2 * f['alpha_se_s'] * 1e6:.0f} us "
          f"({'resolved' if f['alpha_resolved'] else 'not resolved'}), beta = "
          + (f"{_g(beta / 1e9)} GB/s ± {_g(2 * f['beta_rel_se'] * beta / 1e9, 2)}" if beta else "n/a (slope <= 0)")
          + f"; {half}; largest relative error of the fit {100 * f['max_rel_error']:.0f}%")
    if blk:  # the placeholder keeps its v4 name (key_source.md quotes {{q10_c_w2}}); the part is v5's (b)
        v.conclude("Q10", f"q10_c_w{W}", f"(b) at W = {W}, Psi_blk = {blk:,} against N_1/2",
                   latency_or_bandwidth(blk, interval, alpha, beta, W))


def add_steps(v, step: dict) -> None:
    """Q11 and Q13 (b): the step-time ratios with the noise rule; Q11: exposed communication and the speed-up over
    one process."""
    # Q11 and Q13: step ratios (median, min-max over rounds) and exposed communication
    for r in step.get("ratios") or []:
        label = r.get("comparison", "")
        key = {"FSDP + prefetch / FSDP step time": "q11_ratio",
               "2 blocks/unit / 1 block/unit step time (prefetch)": "q13_ratio"}.get(label)
        if not key or not r.get("per_round"):
            continue
        ic = "sim" if str(r.get("interconnect")).startswith("simulated") else "real"
        lo, hi = min(r["per_round"]), max(r["per_round"])
        q = "Q11" if key == "q11_ratio" else "Q13"
        v.add(q, f"{key}_{ic}_w{r['world_size']}", f"{label}, W = {r['world_size']}, {r.get('interconnect')}",
              f"{r['median']:.2f} ({lo:.2f} to {hi:.2f} over {len(r['per_round'])} rounds)")
        v.conclude(q, f"{key}_{ic}_w{r['world_size']}_conclusion",
                   f"{'(a)' if q == 'Q11' else '(b)'} {r.get('interconnect')}, W = {r['world_size']}",
                   resolved(lo, hi, point=r["median"]))
    for r in step.get("results") or []:
        if r.get("strategy") in ("FSDP", "FSDP + prefetch") and isinstance(r.get("exposed"), list) and r["exposed"]:
            ex = [e for e in r["exposed"] if e.get("exposed_comm_fraction") is not None]
            if not ex:
                continue
            # the median over ranks as the table prints it (statistics.median: with an even number of ranks, the
            # mean of the two middle ones)
            fr = sorted(e["exposed_comm_fraction"] for e in ex)
            prof = sorted(e.get("profiled_step_ms") or e["exposed_comm_ms"] / e["exposed_comm_fraction"] for e in ex)
            ic = "sim" if str(r.get("interconnect")).startswith("simulated") else "real"
            name = "q11_exposed_" + ("pf_" if "prefetch" in r["strategy"] else "nopf_") + f"{ic}_w{r['world_size']}"
            v.add("Q11", name, f"{r['strategy']}, W = {r['world_size']}, {r['interconnect']}: exposed share of the "
                  "profiled step (min-max over ranks); profiled vs timed step",
                  f"{statistics.median(fr):.2f} ({fr[0]:.2f} to {fr[-1]:.2f}); profiled step "
                  f"{statistics.median(prof):.0f} ms (median over ranks; {prof[0]:.0f} to {prof[-1]:.0f}) against the "
                  f"timed {r['step_s'] * 1e3:.0f} ms")
        if r.get("strategy") == "FSDP + prefetch" and r.get("vs_one_process"):
            ic = "sim" if str(r.get("interconnect")).startswith("simulated") else "real"
            v.add("Q11", f"q11_vs_one_{ic}_w{r['world_size']}",
                  f"FSDP + prefetch vs one process, W = {r['world_size']}, {r.get('interconnect')}",
                  f"{r['vs_one_process']:.2f}x")
