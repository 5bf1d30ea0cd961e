"""The writeup's answer key, generated: every number in it comes from a results folder (staff only).

    python staff/answer_key/regenerate.py              # run the reference's benchmarks at the default sizes into
                                                       # staff/answer_key/results/ (run_all.py: 279-297 s on 2 quiet
                                                       # cores, 563-1,693 s at load 8-21: the README's timings; the
                                                       # committed run took 271 s at load 3.8, results/run.json), then write
                                                       # NUMBERS.md and ANSWER_KEY.md from it
    python staff/answer_key/regenerate.py --rederive   # no run: rewrite NUMBERS.md and ANSWER_KEY.md from the
                                                       # committed results/ (after editing key_source.md or this file)
    python staff/answer_key/regenerate.py --from PATH  # the TA's calculator: print the expected answers of a
                                                       # student's results: their benchmarks/results/ folder, their
                                                       # submission's root, or submission.zip; writes nothing (no
                                                       # benchmark JSON there: an error, exit status 1)
    python staff/answer_key/regenerate.py --quick      # a smoke run into a temporary folder; writes nothing

ANSWER_KEY.md is rendered from key_source.md: the prose is written there, and every number it carries is a
``{{name}}`` placeholder that ``values()`` below computes from the results (or from the scenario constants of
Q15, which the template's question states). tests/staff/test_answer_key.py fails when key_source.md carries a
number outside a placeholder (a decimal, a number with a unit, a percentage, a fraction in words), when
ANSWER_KEY.md or NUMBERS.md differ from what this script renders from results/, and when results/ were made by
other benchmark code than today's (the fingerprint in results/run.json: the *code*, docstrings and comments
excluded, of the files FINGERPRINTED names).

Timings depend on the machine and its load: the key grades students' timings by their own intervals and the
rules the questions state, never against ours. Memory and byte counts are exact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NUMBERS = HERE / "NUMBERS.md"
KEY = HERE / "ANSWER_KEY.md"
SOURCE = HERE / "key_source.md"
MIB = 2**20
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

# Q15's cluster (the template states these; test_answer_key.py checks the template carries each)
SCENARIO = {"psi": 13e9, "nodes": 2, "gpus_per_node": 4, "gpu_gb": 80, "pcie_gbps": 25, "ag_bytes": 2, "rs_bytes": 4}


def machine() -> dict:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu": cpu, "cores": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "load_1min": round(load[0], 2)}


# The code that produces the results (the benchmark run); regenerate.py itself only derives from them, so editing
# it means re-deriving (--rederive), not re-running the benchmarks.
FINGERPRINTED = ("benchmarks/*.py", "fsdp_assignment/reference/*.py", "fsdp_assignment/support/*.py", "adapters.py")
RESULTS = HERE / "results"  # the staff run's results (JSON and tables), committed: NUMBERS.md and the key derive from it
KEPT = ("memory", "comm", "step", "scaling")
# run_all.py only routes flags and chains the four scripts: what it computes is theirs (and helper fixes to its
# --help must not make the committed results stale)
NOT_FINGERPRINTED = ("benchmarks/run_all.py",
                     "benchmarks/hook_trace.py")  # the students' tracer: it makes none of the results
WORLD_SIZES = (1, 2, 4)  # what the defaults run (memory and scaling; comm and step need W >= 2)


def _code_only(source: str) -> str:
    """The AST of ``source`` without docstrings: what the code computes, not how it is explained."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def sources_fingerprint(root: Path = ROOT) -> str:
    """SHA-256 over the code of the files that determine the numbers (see the module docstring)."""
    import hashlib

    h = hashlib.sha256()
    for pattern in FINGERPRINTED:
        for path in sorted(root.glob(pattern)):
            if path.relative_to(root).as_posix() in NOT_FINGERPRINTED:
                continue
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(_code_only(path.read_text(encoding="utf-8")).encode() + b"\0")
    return h.hexdigest()


def run_benchmarks(out: Path, full: bool) -> dict:
    """Run the reference's benchmarks into a temporary folder and keep their JSON and tables in ``out`` with a
    run.json record: machine, load before and after, command, seconds, the fingerprint of the code that made them."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="answer-key-"))
    cmd = [sys.executable, "benchmarks/run_all.py", "--out", str(tmp)] + ([] if full else ["--quick"])
    env = dict(os.environ, FSDP_IMPL="reference")
    fingerprint, before = sources_fingerprint(), machine()
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    seconds, after = time.monotonic() - t0, machine()
    if sources_fingerprint() != fingerprint:
        raise SystemExit("the benchmark or reference sources changed during the run: run again")
    src = tmp if full else tmp / "quick"
    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        for ext in ("json", "md"):
            if (src / f"{name}.{ext}").exists():
                shutil.copy(src / f"{name}.{ext}", out / f"{name}.{ext}")
    if (src / "step_timeline.png").exists():
        shutil.copy(src / "step_timeline.png", out / "step_timeline.png")
    record = {"command": "FSDP_IMPL=reference python benchmarks/run_all.py" + ("" if full else " --quick"),
              "seconds": round(seconds), "machine_before": before, "machine_after": after,
              "sources_sha256": fingerprint, "fingerprinted": list(FINGERPRINTED), "quick": not full}
    (out / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


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
    """Q10(c)'s rule: Psi_blk against N_1/2's range; an unresolved alpha gives only an upper bound, no beta no N_1/2."""
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

    # Q2: the arithmetic, and the benchmark model's padding
    n, W = 1_000_003, 4
    padded = -(-n // W) * W
    v.add("Q2", "q2_padded", "padded_numel of 1,000,003 at W = 4", f"{padded:,}")
    v.add("Q2", "q2_shard", "shard_numel", f"{padded // W:,}")
    v.add("Q2", "q2_pad_bytes", "padding in bytes (fp32)", f"{4 * (padded - n)} bytes")
    for W in (2, 4):
        r = rows.get(("FSDP", W))
        if r and r.get("model"):
            m = r["model"]
            n_units = m.get("n_block_units", 0) + 1
            v.add("Q2", f"q2_pad_w{W}", f"W S - Psi at W = {W} (FSDP row's model)",
                  f"{W * m['S'] - m['psi']:,} elements (W S = {W * m['S']:,}, Psi = {m['psi']:,}; bound "
                  f"n_units (W - 1) = {n_units * (W - 1)})")
        else:
            v.add("Q2", f"q2_pad_w{W}", f"W S - Psi at W = {W}", "n/a (memory.json: no FSDP row)")
    m = (rows.get(("FSDP", 2)) or rows.get(("FSDP", 4)) or {}).get("model")
    if m:  # why the padding is what it is: each unit pads to a multiple of W on its own
        sizes = {"n_root": m["n_root"], "n_block_unit": m["n_block_unit"]}
        v.add("Q2", "q2_units", "the unit sizes, and their remainders mod 2 and 4",
              "; ".join(f"{k} = {x:,} (mod 2: {x % 2}, mod 4: {x % 4})" for k, x in sizes.items()))
        # Q12: the unsharded curve is in blocks' worth; the root unit is a fraction of a block
        ratio = m["n_root"] / m["n_block_unit"]
        v.add("Q12", "q12_levels", "the unsharded curve's levels in backward (blocks' worth)",
              f"root {ratio:.3f} (Psi_root / Psi_blk); root + the block computing {1 + ratio:.3f}; with the "
              f"prefetched block {2 + ratio:.3f}")
    else:
        v.add("Q2", "q2_units", "unit sizes", "n/a (memory.json: no FSDP row)")
        v.add("Q12", "q12_levels", "unsharded levels", "n/a (memory.json: no FSDP row)")

    # Q5: the global norm's bytes
    for W in (2, 4):
        v.add("Q5", f"q5_bytes_w{W}", f"ring all-reduce of one fp32 scalar at W = {W}, bytes sent per rank",
              f"{2 * (W - 1) / W * 4:g} bytes")

    # Q6 and Q9: memory
    for W in (1, 2, 4):
        r = rows.get(("FSDP", W))
        if r and r.get("model"):
            S = r["model"]["S"]
            optim = (r.get("breakdown_at_peak") or {}).get("optim")
            v.add("Q6", f"q6_w{W}", f"optim measured vs 8 S at W = {W}",
                  f"{_mib(optim)} measured, 8 S = {_mib(8 * S)}")
            steps = r["peak_bytes_all_steps_per_rank"][r["peak_bytes_per_rank"].index(r["peak_bytes"])]
            v.add("Q9", f"q9_fsdp_w{W}", f"FSDP peak (min-max over steps) and model at W = {W}",
                  f"{_mib(r['peak_bytes'])} ({_mib(min(steps))} to {_mib(max(steps))}), model "
                  f"{_mib(r['model']['peak_bytes'])} ({100 * r['model_error']:+.1f}%)")
        else:
            v.add("Q6", f"q6_w{W}", f"W = {W}", "n/a")
            v.add("Q9", f"q9_fsdp_w{W}", f"W = {W}", "n/a")
    errs = [100 * r["model_error"] for r in mem.get("results") or [] if r.get("model_error") is not None
            and students_row(r.get("strategy", ""))]
    v.add("Q9", "q9_err_range", "the student's FSDP rows' model error (torch's FSDP2 row apart), lowest to highest",
          f"{min(errs):+.1f}% to {max(errs):+.1f}%" if errs else "n/a")
    r4 = rows.get(("FSDP", 4))
    if r4:
        top, branch, terms = dominant_term(r4["model"])
        v.add("Q9", "q9_dominant", "the largest term at W = 4, in the branch of the model that sets the peak",
              f"{top}: {_mib(terms[top])}, in the {branch} branch (which sets the peak, "
              f"{_mib(r4['model']['peak_bytes'])}); the branch's other terms: "
              + ", ".join(f"{k} {_mib(x)}" for k, x in terms.items() if k != top))
        v.conclude("Q9", "q9_b_conclusion", "(b)", f"{top} ({branch} branch); another term of that branch earns the "
                   "part only when argued from the Models box; a term of the other branch does not count (its terms "
                   "do not add to the peak)")

    def diff(a: str, b: str, W: int, q: str, name: str) -> None:
        ra, rb = rows.get((a, W)), rows.get((b, W))
        if not (ra and rb):
            v.add(q, name, f"{a} - {b} at W = {W}", "n/a")
            return
        sa = ra["peak_bytes_all_steps_per_rank"][ra["peak_bytes_per_rank"].index(ra["peak_bytes"])]
        sb = rb["peak_bytes_all_steps_per_rank"][rb["peak_bytes_per_rank"].index(rb["peak_bytes"])]
        lo, hi = min(sa) - max(sb), max(sa) - min(sb)
        model = ra["model"]["peak_bytes"] - rb["model"]["peak_bytes"]
        verdict = resolved(lo, hi, 0.0, below="smaller", above="larger", point=ra["peak_bytes"] - rb["peak_bytes"])
        v.add(q, name, f"{a} minus {b}, peak at W = {W}: measured (range over steps), model",
              f"{_mib(ra['peak_bytes'] - rb['peak_bytes'])} measured ({_mib(lo)} to {_mib(hi)}), model "
              f"{_mib(model)} (U_p {_mib(ra['model']['unsharded_params_bytes'] - rb['model']['unsharded_params_bytes'])}, "
              f"U_g {_mib(ra['model']['unsharded_grads_bytes'] - rb['model']['unsharded_grads_bytes'])})")
        v.conclude(q, name + "_conclusion", f"{a} minus {b} at W = {W}", verdict)

    diff("FSDP no-reshard", "FSDP", 4, "Q9", "q9_noreshard")
    diff("FSDP + prefetch", "FSDP", 4, "Q9", "q9_prefetch")
    diff("FSDP + prefetch, 2 blocks/unit", "FSDP + prefetch", 4, "Q13", "q13_mem")
    if r4:
        v.add("Q9", "q9_blk", "one block unit, 4 Psi_blk", _mib(4 * r4["model"]["n_block_unit"]))
    else:
        v.add("Q9", "q9_blk", "one block unit", "n/a")

    # Q10: the script's fits
    psi_root, psi = root_params(gpt) if gpt else (None, None)
    blk = (psi - psi_root) // gpt["n_layer"] if gpt else None
    v.add("Q10", "q10_blk", "Psi_blk (one block)", f"{blk:,} elements" if blk else "n/a")
    v.add("Q10", "q10_psi_per_layer", "Psi / n_layer, the root's embeddings counted in (not Psi_blk)",
          f"{psi // gpt['n_layer']:,} elements" if gpt else "n/a")
    for W in (2, 4):
        f = fit_of(comm, W)
        if not f:
            v.add("Q10", f"q10_fit_w{W}", f"all-gather fit at W = {W}", "n/a (comm.json: no fit)")
            v.conclude("Q10", f"q10_c_w{W}", f"(c) at W = {W}", "no fit at this W: the part is not answerable")
            continue
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
        if blk:
            v.conclude("Q10", f"q10_c_w{W}", f"(c) at W = {W}, Psi_blk = {blk:,} against N_1/2",
                       latency_or_bandwidth(blk, interval, alpha, beta, W))
        coll = [c for c in comm.get("collectives") or [] if c.get("world_size") == W and c.get("kind") == "all_gather"]
        if coll:
            ag = max(coll, key=lambda c: c.get("busbw_gbps", 0))
            v.add("Q10", f"q10_best_w{W}", f"highest all-gather bus bandwidth in the collectives table at W = {W}",
                  f"{ag['busbw_gbps']:.3g} GB/s at {ag['size']:,} bytes")
            if beta is None:
                verdict = "no beta to compare (slope <= 0): say so"
            else:
                lo, hi = beta_range(f, beta)
                x = ag["busbw_gbps"] * 1e9
                verdict = (f"the all-gather's highest busbw {ag['busbw_gbps']:.3g} GB/s is "
                           + ("inside" if lo <= x <= hi else "outside")
                           + f" beta's ± 2 SE range ({_g(max(lo, 0) / 1e9)} to {_g(hi / 1e9)} GB/s): "
                           + ("they agree" if lo <= x <= hi else "they do not agree: the answer says so and why"))
            v.conclude("Q10", f"q10_d_w{W}", f"(d) at W = {W}", verdict)

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

    # Q13: collectives per step
    if gpt:
        n1, n2 = gpt["n_layer"] + 1, gpt["n_layer"] // 2 + 1
        f = fit_of(comm, 2)
        lat = ""
        if f:
            if f["alpha_resolved"] and f["alpha_s"] > 0:
                lat = f"; at W = 2 that saves 3 x {n1 - n2} x alpha = {3 * (n1 - n2) * f['alpha_s'] * 1e3:.2f} ms per step"
            else:
                lat = (f"; alpha not resolved at W = 2: the saving is below 3 x {n1 - n2} x alpha_bound = "
                       f"{3 * (n1 - n2) * f['alpha_bound_s'] * 1e3:.2f} ms per step")
        v.add("Q13", "q13_colls", "collectives per step, 1 and 2 blocks per unit",
              f"3 x {n1} = {3 * n1} and 3 x {n2} = {3 * n2}{lat}")
        if f:
            v.conclude("Q13", "q13_c_conclusion", "(c)",
                       "a saving of 3 (n_units1 - n_units2) alpha" if f["alpha_resolved"] and f["alpha_s"] > 0 else
                       "alpha not resolved (or <= 0): only the upper bound on the saving (alpha_bound); a saving "
                       "computed from the unresolved alpha as a value loses the part")

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
            v.conclude("Q14", "q14_c_conclusion", "(c)", "no W*: the fit has no beta (slope <= 0); say so: full marks")
            v.conclude("Q14", "q14_d_conclusion", "(d)", "undecided on this machine: no W* to compare with; say so")
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
            v.conclude("Q14", "q14_c_conclusion", "(c) W = 2 against W*",
                       resolved(lo, hi, 2.0, below="W* below 2: communication limits the step at W = 2",
                                above="W* above 2: compute limits the step at W = 2", point=point,
                                sides=("communication-limited", "compute-limited")))
            e_lo, e_hi = eff2(a_hi, b_lo), eff2(a_lo, b_hi)
            m = weak.get(2)
            if m and not math.isfinite(point):  # the template's rule: with no W*, (d) is undecided
                v.conclude("Q14", "q14_d_conclusion", "(d) at W = 2",
                           "undecided at this precision: there is no W* (alpha not resolved, so alpha = 0, and "
                           "c <= T_comp): say so; an answer that concludes agree or do not agree earns half")
            elif m:
                m_lo, m_hi = m.get("efficiency_range") or (m["efficiency"], m["efficiency"])
                agree = m_hi >= e_lo and m_lo <= e_hi
                v.conclude("Q14", "q14_d_conclusion", "(d) at W = 2",
                           f"the model predicts an efficiency of {e_lo:.2f} to {e_hi:.2f} (perfect overlap, the fit's "
                           f"± 2 SE); measured {m['efficiency']:.2f} ({m_lo:.2f} to {m_hi:.2f}): "
                           + ("they agree (the ranges overlap)" if agree else
                              "they do not agree (the ranges are apart): the answer names what else limits the step "
                              "(cores shared by the ranks, latency, overlap that is not perfect)"))
    else:
        v.add("Q14", "q14_wstar", "W*", "n/a (scaling.json or comm.json missing)")
        v.conclude("Q14", "q14_c_conclusion", "(c)", "not answerable from these results (no W = 2 fit or no scaling)")

    # Q15: the scenario
    sc = SCENARIO
    P, Wc, R, K = sc["psi"], sc["nodes"] * sc["gpus_per_node"], sc["nodes"], sc["gpus_per_node"]
    states = {"DDP": 16 * P, "ZeRO-2": 2 * P + 14 * P / Wc, "FSDP": 16 * P / Wc, "HSDP": 16 * P / K}
    v.add("Q15", "q15_states", "model-state GB per GPU",
          "; ".join(f"{k} {x / 1e9:.2f} GB ({'fits' if x < sc['gpu_gb'] * 1e9 else 'does not fit'} in "
                    f"{sc['gpu_gb']} GB)" for k, x in states.items()))
    ag, rs = sc["ag_bytes"], sc["rs_bytes"]
    per_link = (Wc - 1) / Wc * (2 * ag + rs) * P      # two all-gathers and one reduce-scatter over one ring link
    fsdp_x = 2 * per_link                            # two of the ring's links cross the nodes
    hsdp_x = Wc * 2 * (R - 1) / R * rs * P / K       # every GPU all-reduces its fp32 gradient shard across replicas
    v.add("Q15", "q15_fsdp_x", "FSDP inter-node bytes per step (two ring links)",
          f"2 x (W - 1)/W x ({2 * ag} + {rs}) Psi = {fsdp_x / P:.3g} Psi = {fsdp_x / 1e9:.0f} GB")
    v.add("Q15", "q15_hsdp_x", "HSDP inter-node bytes per step (summed over GPUs)",
          f"W x 2 (R - 1)/R x {rs} Psi / K = {hsdp_x / P:.3g} Psi = {hsdp_x / 1e9:.0f} GB")
    v.add("Q15", "q15_ratio", "FSDP / HSDP inter-node bytes", f"{fsdp_x / hsdp_x:.3g}")
    h2d, d2h = 2 * 4 * P / Wc, 4 * P / Wc
    link = sc["pcie_gbps"] * 1e9
    v.add("Q15", "q15_offload", "CPU offload: H2D, D2H per GPU per step, and time on the full-duplex link",
          f"H2D 2 x 4 Psi / W = {h2d / 1e9:.2f} GB, D2H 4 Psi / W = {d2h / 1e9:.2f} GB; full duplex: max(H2D, D2H) / "
          f"{sc['pcie_gbps']} GB/s = {max(h2d, d2h) / link * 1e3:.0f} ms (one shared direction would take "
          f"{(h2d + d2h) / link * 1e3:.0f} ms: accept it only with that assumption stated)")
    v.add("Q15", "q15_scenario", "the scenario as the question states it",
          f"Psi = {P / 1e9:.0f}B, {sc['nodes']} nodes x {sc['gpus_per_node']} GPUs of {sc['gpu_gb']} GB, PCIe "
          f"{sc['pcie_gbps']} GB/s per direction")
    return v


def bands(results: Path) -> list[str]:
    """The handout's table of what good results look like (handout/benchmarks.typ, @tab-bands): ours, and the band.
    Exact quantities get tight bands; timings a direction, with the noise rule for the ratio."""
    mem, comm, step = (load(results, n) for n in ("memory", "comm", "step"))
    out = ["| quantity | ours (this run) | band in the handout |", "| --- | --- | --- |"]
    rows = {(r.get("strategy"), r.get("world_size")): r for r in mem.get("results") or []}
    one = rows.get(("one process", 1))
    for W in (2, 4):
        r = rows.get(("FSDP", W))
        if one and r:
            out.append(f"| FSDP peak / one process, W = {W} | {r['peak_bytes'] / one['peak_bytes']:.2f} | below "
                       f"{1 / W + 0.25:.2f} |")
    errs = [abs(r["model_error"]) for r in mem.get("results") or [] if r.get("model_error") is not None
            and students_row(str(r.get("strategy", "")))]
    if errs:  # the student's own FSDP rows: torch's FSDP2 row is not theirs to explain
        out.append(f"| FSDP rows' model error (yours, FSDP2 apart), largest | {100 * max(errs):.1f}% | within 20% |")
    ratios = [r["ratio"] for r in comm.get("bytes_per_step") or [] if r.get("strategy", "").startswith("FSDP")
              and "FSDP2" not in r.get("strategy", "") and r.get("ratio") is not None]
    if ratios:
        out.append(f"| FSDP counted / formula bytes | {min(ratios):.4f} to {max(ratios):.4f} | 1.000 |")
    for r in step.get("ratios") or []:
        if r.get("comparison", "").startswith("FSDP + prefetch / FSDP step") and r.get("per_round"):
            out.append(f"| prefetch / no prefetch step time, {r.get('interconnect')}, W = {r.get('world_size')} | "
                       f"{r['median']:.2f} ({min(r['per_round']):.2f} to {max(r['per_round']):.2f}) | "
                       f"below 1, or an interval containing 1 (undecided at this precision) |")
    return out


def tables(results: Path) -> list[str]:
    out = []
    for name in ("memory", "comm", "step", "scaling"):
        md = results / f"{name}.md"
        if md.exists():
            out += ["", f"### {name}", "", *md.read_text().strip().splitlines()]
    return out


def numbers_md(results: Path, v: Values, record: dict) -> str:
    m = record.get("machine_before") or {}
    after = record.get("machine_after") or {}
    lines = ["<!-- STAFF ANSWER KEY: never in the student release (staff/release.py refuses it). -->",
             "# Answer key numbers (generated: do not edit by hand)", "",
             "Regenerate: `python staff/answer_key/regenerate.py` (see its docstring); the results it derives from are "
             "in `staff/answer_key/results/`.", "",
             f"- Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, no GPU; load average (1 min) "
             f"{m.get('load_1min', '?')} before the run, {after.get('load_1min', '?')} after (the run's own ranks count "
             f"in that; a load above the cores before it means other jobs shared the machine)"
             + (f"; observed during the run: {', '.join(f'{x:g}' for x in record['load_observed_1min'])}."
                if record.get("load_observed_1min") else "."),
             f"- Command: `{record.get('command', '?')}`, {record.get('seconds', '?')} s.",
             f"- Results fingerprint: `{str(record.get('sources_sha256', '?'))[:16]}`.", ""]
    for q, items in v.by_q.items():
        lines += [f"## {q}", ""] + [f"- `{name}`: {what}: {value}" for name, what, value in items] + [""]
    lines += ["## Bands", ""] + bands(results) + ["", "## The benchmark tables (verbatim)"] + tables(results)
    return "\n".join(lines) + "\n"


def render_key(source: str, v: Values, strict: bool = True) -> str:
    """key_source.md with every {{name}} replaced by its value; strict: a placeholder without a value is an error
    (the staff run has every W; a --quick run has W = 2 only, and shows "n/a" there)."""
    flat = v.flat()
    missing = sorted(set(PLACEHOLDER.findall(source)) - set(flat))
    if missing and strict:
        raise KeyError(f"key_source.md uses placeholders values() does not compute from these results: {missing}")
    return PLACEHOLDER.sub(lambda m: flat.get(m.group(1), "n/a (not in this run)"), source)


# What decides the questions that compare no measured interval with a threshold (the key grades them from the
# student's code, picture or arithmetic).
NO_THRESHOLD = {"Q1": "no threshold: the student's own design, from their printout of a run (the key's list)",
                "Q2": "no threshold: exact numbers (padding), the same for every student",
                "Q3": "no threshold: the student's own design, from their hook_trace.py output (the key's list)",
                "Q4": "no threshold: formulas",
                "Q5": "no threshold: the student's printout of one clip, and exact bytes (ring formula)",
                "Q6": "no threshold: exact bytes (optim = 8 S) and the student's measured state-dict peaks",
                "Q7": "no threshold: the student's own design, from their hook_trace.py --prefetch output",
                "Q8": "no threshold: dtypes from the student's trace and code, bytes as formulas in Psi and W",
                "Q12": "no threshold: read from the student's picture (the key's list)",
                "Q15": "no threshold: the scenario's arithmetic (the key's numbers)"}


def expected_answers(folder: Path) -> str:
    """The TA's calculator (--from): per question, the quantities computed from this results folder, then the
    conclusion each threshold part's rule gives on them (Models box item 4: a straddling interval is "undecided at
    this precision"; alpha unresolved or <= 0: alpha = 0 and alpha_bound; beta <= 0: no beta, no N_1/2, no W*)."""
    sys.path.insert(0, str(ROOT))
    from tests.points import WRITEUP_QUESTION_POINTS

    v = values(folder)
    out = [f"Expected answers from {folder} (computed from this student's JSON; a conclusion is what the question's "
           "rule gives on these numbers):", ""]
    for q in WRITEUP_QUESTION_POINTS:
        out.append(q)
        out += [f"  {what}: {value}" for _, what, value in v.by_q.get(q, []) if not what.startswith("expected conclusion")]
        concl = v.conclusions.get(q)
        if concl:
            out += [f"  EXPECTED CONCLUSION {part}: {text}" for part, text in concl]
        else:
            out.append(f"  EXPECTED CONCLUSION: {NO_THRESHOLD.get(q, 'no threshold')}")
    return "\n".join(out)


def find_results(source: Path) -> Path:
    """The folder of benchmark JSON in ``source``: a results folder itself, a submission's root (its
    ``benchmarks/results/``), a folder holding ``results/``, or a submission zip (unpacked into a temporary folder,
    then searched the same way). Raises SystemExit, with what to give instead, when none holds a benchmark's JSON."""
    import shutil
    import zipfile

    wanted = [f"{n}.json" for n in KEPT]

    def holds(folder: Path) -> bool:
        return folder.is_dir() and any((folder / n).is_file() for n in wanted)

    if source.is_file():
        if not zipfile.is_zipfile(source):
            raise SystemExit(f"regenerate.py --from {source}: not a folder and not a zip: give the student's "
                             "benchmarks/results/ folder, their submission's root, or their submission zip")
        tmp = Path(tempfile.mkdtemp(prefix="answer-key-from-"))
        with zipfile.ZipFile(source) as zf:
            for member in zf.namelist():  # only the benchmarks' JSON: nothing else is read, nothing runs
                if Path(member).name in wanted and ".." not in Path(member).parts and not member.startswith("/"):
                    zf.extract(member, tmp)
        found = sorted({p.parent for p in tmp.rglob("*.json")}, key=lambda d: (not d.as_posix().endswith(
            "benchmarks/results"), len(d.parts)))
        if not found:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"regenerate.py --from {source}: the zip holds no benchmark results "
                             f"({', '.join(wanted)} under benchmarks/results/): the student submitted none; grade "
                             "their measured parts from their pasted tables only, or ask for the results")
        return found[0]
    for folder in (source, source / "benchmarks" / "results", source / "results"):
        if holds(folder):
            return folder
    raise SystemExit(f"regenerate.py --from {source}: no benchmark results there (looked for {', '.join(wanted)} in "
                     f"it, in benchmarks/results/ and in results/): give the student's benchmarks/results/ folder, "
                     "their submission's root, or their submission zip")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\nANSWER_KEY.md")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--from", dest="source", type=Path,
                   help="print the expected answers of these results: a results folder, a submission's root or zip")
    g.add_argument("--rederive", action="store_true", help="rewrite NUMBERS.md and ANSWER_KEY.md from results/")
    g.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder; writes nothing")
    args = p.parse_args(argv)
    if args.source:
        folder = find_results(args.source)
        missing = [f"{n}.json" for n in KEPT if not (folder / f"{n}.json").exists()]
        if missing:
            print(f"regenerate.py --from: {folder} has no {', '.join(missing)}: the questions that read them show "
                  "n/a", file=sys.stderr)
        print(expected_answers(folder))
        return 0
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="answer-key-quick-"))
        run_benchmarks(tmp, full=False)
        print(render_key(SOURCE.read_text(encoding="utf-8"), values(tmp), strict=False)[:2000])
        return 0
    if not args.rederive:
        run_benchmarks(RESULTS, full=True)
    record = json.loads((RESULTS / "run.json").read_text())
    v = values(RESULTS)
    NUMBERS.write_text(numbers_md(RESULTS, v, record))
    KEY.write_text(render_key(SOURCE.read_text(encoding="utf-8"), v))
    print(f"wrote {NUMBERS.relative_to(ROOT)} and {KEY.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
