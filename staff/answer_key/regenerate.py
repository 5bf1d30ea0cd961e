"""The writeup's answer key, generated: every number in it comes from a results folder (staff only).

    python staff/answer_key/regenerate.py              # run the reference's benchmarks at the default sizes into
                                                       # staff/answer_key/results/ (about 10 minutes on 2 loaded
                                                       # cores), then write NUMBERS.md and ANSWER_KEY.md from it
    python staff/answer_key/regenerate.py --rederive   # no run: rewrite NUMBERS.md and ANSWER_KEY.md from the
                                                       # committed results/ (after editing key_source.md or this file)
    python staff/answer_key/regenerate.py --from DIR   # the TA's calculator: print the expected answers of a
                                                       # student's results folder (benchmarks/results/, or the JSON
                                                       # files in their submission); writes nothing
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
NOT_FINGERPRINTED = ("benchmarks/run_all.py",)
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


def resolved(lo: float, hi: float, threshold: float = 1.0, below: str = "faster", above: str = "slower") -> str:
    """The handout's noise rule (Models box, item 4): resolved only when the whole interval is on one side."""
    if hi < threshold:
        return f"resolved: {below}"
    if lo > threshold:
        return f"resolved: {above}"
    return "not resolved on this machine (the interval contains 1)"


def fit_of(comm: dict, w: int, kind: str = "all_gather") -> dict | None:
    """The script's own fit (bench_comm.py's alpha_beta records) for ``kind`` at W = w, on the real interconnect."""
    return next((f for f in comm.get("alpha_beta") or [] if f.get("kind") == kind and f.get("world_size") == w
                 and str(f.get("interconnect", "gloo")).startswith(("gloo", "nccl"))), None)


def crossover_w(alpha: float, beta: float, t_comp: float, psi: int, units: int, b: int = 4) -> float | None:
    """The Models box's W*: the positive root of a W^2 + (c - a - T) W - c = 0, a = 3 n_units alpha, c = 3 psi b /
    beta; with alpha <= 0 (the rule for an unresolved alpha: 0) W* = c / (c - T) if c > T, else None (never)."""
    a, c, t = 3 * units * alpha, 3 * psi * b / beta, t_comp
    if a <= 0:
        return c / (c - t) if c > t else None
    return ((t + a - c) + ((t + a - c) ** 2 + 4 * a * c) ** 0.5) / (2 * a)


class Values:
    """What the key quotes: per question, (name, what it is, the value as printed)."""

    def __init__(self):
        self.by_q: dict[str, list[tuple[str, str, str]]] = {}

    def add(self, q: str, name: str, what: str, value) -> None:
        self.by_q.setdefault(q, []).append((name, what, str(value)))

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
            and str(r.get("strategy", "")).startswith("FSDP")]
    v.add("Q9", "q9_err_range", "FSDP rows' model error, lowest to highest",
          f"{min(errs):+.1f}% to {max(errs):+.1f}%" if errs else "n/a")
    r4 = rows.get(("FSDP", 4))
    if r4:
        m = r4["model"]
        terms = {"16 S (model states)": 16 * m["S"], "A (activations)": m["activations_bytes"],
                 "4 (U_p + U_g) (unsharded)": m["unsharded_params_bytes"] + m["unsharded_grads_bytes"],
                 "4 U_end": m["end_extra_bytes"]}
        top = max(terms, key=terms.get)
        v.add("Q9", "q9_dominant", "the largest term of the model at W = 4",
              f"{top}: {_mib(terms[top])}; then " + ", ".join(f"{k} {_mib(x)}" for k, x in terms.items() if k != top))

    def diff(a: str, b: str, W: int, q: str, name: str) -> None:
        ra, rb = rows.get((a, W)), rows.get((b, W))
        if not (ra and rb):
            v.add(q, name, f"{a} - {b} at W = {W}", "n/a")
            return
        sa = ra["peak_bytes_all_steps_per_rank"][ra["peak_bytes_per_rank"].index(ra["peak_bytes"])]
        sb = rb["peak_bytes_all_steps_per_rank"][rb["peak_bytes_per_rank"].index(rb["peak_bytes"])]
        lo, hi = min(sa) - max(sb), max(sa) - min(sb)
        model = ra["model"]["peak_bytes"] - rb["model"]["peak_bytes"]
        verdict = "resolved" if lo > 0 or hi < 0 else "not resolved (the spreads overlap)"
        v.add(q, name, f"{a} minus {b}, peak at W = {W}: measured (range over steps), model",
              f"{_mib(ra['peak_bytes'] - rb['peak_bytes'])} measured ({_mib(lo)} to {_mib(hi)}, {verdict}), model "
              f"{_mib(model)} (U_p {_mib(ra['model']['unsharded_params_bytes'] - rb['model']['unsharded_params_bytes'])}, "
              f"U_g {_mib(ra['model']['unsharded_grads_bytes'] - rb['model']['unsharded_grads_bytes'])})")

    diff("FSDP no-reshard", "FSDP", 4, "Q9", "q9_noreshard")
    diff("FSDP + prefetch", "FSDP", 4, "Q9", "q9_prefetch")
    diff("FSDP + prefetch, 2 blocks/unit", "FSDP + prefetch", 4, "Q13", "q13_mem")
    if r4:
        v.add("Q9", "q9_blk", "one block unit, 4 Psi_blk", _mib(4 * r4["model"]["n_block_unit"]))
    else:
        v.add("Q9", "q9_blk", "one block unit", "n/a")

    # Q8: the tied weight
    if gpt:
        tied = gpt["vocab_size"] * gpt["n_embd"]
        v.add("Q8", "q8_tied", "vocab x n_embd", f"{gpt['vocab_size']} x {gpt['n_embd']} = {tied:,} elements")
        v.add("Q8", "q8_saved", "saved at W = 2: elements per rank per step, model-state bytes per rank",
              f"3 x {tied:,} x 1/2 = {3 * tied // 2:,} elements per rank per step, and 16 x {tied:,} / 2 = "
              f"{_mib(8 * tied)} of model states per rank")

    # Q10: the script's fits
    psi_root, psi = root_params(gpt) if gpt else (None, None)
    blk = (psi - psi_root) // gpt["n_layer"] if gpt else None
    v.add("Q10", "q10_blk", "Psi_blk (one block)", f"{blk:,} elements" if blk else "n/a")
    for W in (2, 4):
        f = fit_of(comm, W)
        if not f:
            v.add("Q10", f"q10_fit_w{W}", f"all-gather fit at W = {W}", "n/a (comm.json: no fit)")
            continue
        beta = f["beta_bytes_per_s"]
        ok_beta = isinstance(beta, float) and math.isfinite(beta) and beta > 0
        alpha_use = f["alpha_s"] if f["alpha_resolved"] and f["alpha_s"] > 0 else None
        if alpha_use and ok_beta:
            half = f"N_1/2 = W alpha beta / b = {W * alpha_use * beta / 4:,.0f} elements"
        elif ok_beta:
            half = (f"alpha not resolved: N_1/2 < W alpha_bound beta / b = {W * f['alpha_bound_s'] * beta / 4:,.0f} "
                    f"elements (alpha_bound = {f['alpha_bound_s'] * 1e6:.0f} us)")
        else:
            half = "n/a (beta not positive)"
        v.add("Q10", f"q10_fit_w{W}", f"all-gather fit at W = {W}",
              f"alpha = {f['alpha_s'] * 1e6:.0f} ± {2 * f['alpha_se_s'] * 1e6:.0f} us "
              f"({'resolved' if f['alpha_resolved'] else 'not resolved'}), beta = {_g(beta / 1e9)} GB/s "
              f"± {_g(2 * f['beta_rel_se'] * beta / 1e9, 2)}; {half}; largest relative error of the fit "
              f"{100 * f['max_rel_error']:.0f}%")
        coll = [c for c in comm.get("collectives") or [] if c.get("kind") == "all_gather" and c.get("world_size") == W]
        if coll:
            best = max(coll, key=lambda c: c.get("busbw_gbps", 0))
            v.add("Q10", f"q10_best_w{W}", f"highest all-gather bus bandwidth at W = {W}",
                  f"{best['busbw_gbps']:.3g} GB/s at {best['size']:,} bytes")

    # Q11 and Q13: step ratios (median, min-max over rounds) and exposed communication
    for r in step.get("ratios") or []:
        label = r.get("comparison", "")
        key = {"FSDP + prefetch / FSDP step time": "q11_ratio",
               "2 blocks/unit / 1 block/unit step time (prefetch)": "q13_ratio"}.get(label)
        if not key or not r.get("per_round"):
            continue
        ic = "sim" if str(r.get("interconnect")).startswith("simulated") else "real"
        lo, hi = min(r["per_round"]), max(r["per_round"])
        v.add("Q11" if key == "q11_ratio" else "Q13", f"{key}_{ic}_w{r['world_size']}",
              f"{label}, W = {r['world_size']}, {r.get('interconnect')}",
              f"{r['median']:.2f} ({lo:.2f} to {hi:.2f} over {len(r['per_round'])} rounds): {resolved(lo, hi)}")
    for r in step.get("results") or []:
        if r.get("strategy") in ("FSDP", "FSDP + prefetch") and isinstance(r.get("exposed"), list) and r["exposed"]:
            ex = [e for e in r["exposed"] if e.get("exposed_comm_fraction") is not None]
            if not ex:
                continue
            fr = sorted(e["exposed_comm_fraction"] for e in ex)
            prof = sorted(e.get("profiled_step_ms") or e["exposed_comm_ms"] / e["exposed_comm_fraction"] for e in ex)
            ic = "sim" if str(r.get("interconnect")).startswith("simulated") else "real"
            name = "q11_exposed_" + ("pf_" if "prefetch" in r["strategy"] else "nopf_") + f"{ic}_w{r['world_size']}"
            v.add("Q11", name, f"{r['strategy']}, W = {r['world_size']}, {r['interconnect']}: exposed share of the "
                  "profiled step (min-max over ranks); profiled vs timed step",
                  f"{fr[len(fr) // 2]:.2f} ({fr[0]:.2f} to {fr[-1]:.2f}); profiled step {prof[len(prof) // 2]:.0f} ms "
                  f"against the timed {r['step_s'] * 1e3:.0f} ms")
        if r.get("strategy") == "FSDP + prefetch" and r.get("vs_one_process") and str(r.get("interconnect")).startswith("gloo"):
            v.add("Q11", f"q11_vs_one_w{r['world_size']}", f"FSDP + prefetch vs one process, W = {r['world_size']}",
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

    # Q14: W*
    base = next((r for r in scaling.get("results") or [] if r.get("scaling") == "weak" and r.get("strategy") == "FSDP"
                 and r.get("world_size") == 1), None)
    f = fit_of(comm, 2)
    if base and f and gpt:
        units = gpt["n_layer"] + 1
        alpha = f["alpha_s"] if f["alpha_resolved"] and f["alpha_s"] > 0 else 0.0
        beta = f["beta_bytes_per_s"]
        if isinstance(beta, float) and math.isfinite(beta) and beta > 0:
            w_star = crossover_w(alpha, beta, base["step_s"], base["psi_params"], units)
            rule = "" if alpha else f" (alpha {f['alpha_s'] * 1e6:.0f} us not resolved: alpha = 0, the Models box's rule)"
            v.add("Q14", "q14_wstar", "a, c, T_comp and W* from the W = 2 all-gather fit",
                  f"n_units = {units}, a = {3 * units * alpha * 1e3:.2f} ms{rule}, c = "
                  f"{3 * base['psi_params'] * 4 / beta * 1e3:.0f} ms, T_comp = {base['step_s'] * 1e3:.0f} ms, W* = "
                  + (f"{w_star:.2f}" if w_star is not None else "none (c <= T_comp: communication never limits)"))
        else:
            v.add("Q14", "q14_wstar", "W*", "n/a (beta not positive)")
    else:
        v.add("Q14", "q14_wstar", "W*", "n/a (scaling.json or comm.json missing)")
    weak = {r["world_size"]: r for r in scaling.get("results") or [] if r.get("scaling") == "weak" and r.get("strategy") == "FSDP"}
    v.add("Q14", "q14_weak_eff", "weak-scaling FSDP efficiency at W = 2, 4",
          ", ".join(f"W = {w}: {_g(weak[w].get('efficiency'))}" for w in (2, 4) if w in weak) or "n/a")

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
            and str(r.get("strategy", "")).startswith("FSDP")]
    if errs:
        out.append(f"| FSDP rows' model error, largest | {100 * max(errs):.1f}% | within 20% |")
    ratios = [r["ratio"] for r in comm.get("bytes_per_step") or [] if r.get("strategy", "").startswith("FSDP")
              and "FSDP2" not in r.get("strategy", "") and r.get("ratio") is not None]
    if ratios:
        out.append(f"| FSDP counted / formula bytes | {min(ratios):.4f} to {max(ratios):.4f} | 1.000 |")
    for r in step.get("ratios") or []:
        if r.get("comparison", "").startswith("FSDP + prefetch / FSDP step") and r.get("per_round"):
            out.append(f"| prefetch / no prefetch step time, {r.get('interconnect')}, W = {r.get('world_size')} | "
                       f"{r['median']:.2f} ({min(r['per_round']):.2f} to {max(r['per_round']):.2f}) | "
                       f"below 1, or an interval containing 1 (not resolved) |")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--from", dest="source", type=Path, help="print the expected answers of this results folder")
    g.add_argument("--rederive", action="store_true", help="rewrite NUMBERS.md and ANSWER_KEY.md from results/")
    g.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder; writes nothing")
    args = p.parse_args(argv)
    if args.source:
        folder = args.source / "results" if (args.source / "results" / "memory.json").exists() else args.source
        v = values(folder)
        print(f"Expected answers from {folder} (the numbers the key quotes, computed from this student's JSON):\n")
        for q, items in v.by_q.items():
            print(f"{q}")
            for _, what, value in items:
                print(f"  {what}: {value}")
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
