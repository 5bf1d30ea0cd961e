"""Regenerate the numbers of the writeup's answer key from the reference's own benchmark run (staff only).

    python staff/answer_key/regenerate.py             # the benchmarks' default sizes, W = 1, 2, 4, then NUMBERS.md
    python staff/answer_key/regenerate.py --quick     # a smoke run: tests/staff/test_answer_key.py rejects its file
    python staff/answer_key/regenerate.py --from DIR  # no run: use the results already in DIR (run_all.py --out DIR)

It runs ``FSDP_IMPL=reference python benchmarks/run_all.py --out <tmp>`` (about 5 minutes on a 2-core machine at
load 2 to 6; see NUMBERS.md's header for the last run) and writes ``staff/answer_key/NUMBERS.md``: the machine
(CPU model, cores, load average before and after, torch), the exact command, the run's configuration and a
fingerprint of the sources that determine its numbers (both in a ``<!-- run: {...} -->`` line that the staff
test reads), the four benchmark tables as the reference printed them, and per writeup question the numbers the
key (``staff/answer_key/ANSWER_KEY.md``) refers to, each computed here from the benchmark JSON or from the stated
arithmetic, never typed in. A field the benchmarks no longer write shows as "n/a" with its name, rather than
failing the whole run.

Staleness: the fingerprint is a SHA-256 over the *code* (the AST, docstrings dropped; comments never reach it) of
``benchmarks/*.py``, ``fsdp_assignment/reference/*.py``, ``fsdp_assignment/support/*.py``, ``adapters.py`` and
this file. Editing a comment or a docstring keeps NUMBERS.md fresh; changing what any of them computes makes it
stale, and ``tests/staff/test_answer_key.py`` says so until this script is re-run.

Timings depend on the machine and its load: grade students' timings on reasoning and internal consistency, not
against these values. Memory and byte counts are exact (they do not depend on the load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "NUMBERS.md"
MIB = 2**20


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


def fmt(x, unit="", digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}{unit}"
    return f"{x:,}{unit}" if isinstance(x, int) else f"{x}{unit}"


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


def section(lines: list[str], title: str) -> None:
    lines += ["", f"## {title}", ""]


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


def run_config(results: Path) -> dict:
    """What the run was: quick or not, and the W each benchmark's results cover (from the JSON, not the flags)."""
    out = {"quick": False, "world_sizes": {}}
    for name in ("memory", "comm", "step", "scaling"):
        data = load(results, name)
        out["quick"] = out["quick"] or bool((data.get("config") or {}).get("quick"))
        rows = data.get("results") or data.get("collectives") or []
        out["world_sizes"][name] = sorted({r["world_size"] for r in rows if isinstance(r, dict) and "world_size" in r})
    return out


def alpha_beta_fit(comm: dict, kind: str = "all_gather") -> dict[int, dict]:
    """Per W: least squares of T = (W-1) alpha + (W-1)/W N / beta over every measured size N (bytes, the full
    buffer) of ``kind`` over real gloo: x = (W-1)/W N, slope 1/beta, intercept (W-1) alpha (the Models box)."""
    coll = [c for c in comm.get("collectives") or [] if c.get("kind") == kind and c.get("seconds")
            and str(c.get("interconnect", "gloo")).startswith("gloo")]
    fits = {}
    for W in sorted({c["world_size"] for c in coll}):
        pts = [(c["size"] * (W - 1) / W, c["seconds"]) for c in coll if c["world_size"] == W]
        if len(pts) < 2 or W < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")
        alpha = (my - slope * mx) / (W - 1)
        beta = 1 / slope if slope > 0 else float("nan")  # bytes/s
        best = max((c for c in coll if c["world_size"] == W), key=lambda c: c.get("busbw_gbps", 0))
        fits[W] = {"alpha_s": alpha, "beta_Bps": beta, "n": len(pts), "sizes": (min(c["size"] for c in coll if c["world_size"] == W),
                                                                               max(c["size"] for c in coll if c["world_size"] == W)),
                   "best_busbw_gbps": best.get("busbw_gbps"), "best_size": best["size"]}
    return fits


def crossover_w(alpha: float, beta: float, t_comp: float, psi: int, units: int, b: int = 4) -> float:
    """The W above which T_comm(W) = 3 U (W-1) alpha + 3 (W-1)/W psi b / beta exceeds t_comp (weak scaling,
    perfect overlap): the positive root of a W^2 + (c - a - T) W - c = 0, a = 3 U alpha, c = 3 psi b / beta."""
    a, c, t = 3 * units * alpha, 3 * psi * b / beta, t_comp
    if a <= 0:
        return c / (c - t) if c > t else float("inf")
    return ((t + a - c) + ((t + a - c) ** 2 + 4 * a * c) ** 0.5) / (2 * a)


def bands(mem: dict, comm: dict, step: dict, scaling: dict) -> list[str]:
    """Per quantity of the handout's "what good results look like" table: ours, and the band we print there.
    Exact quantities get tight bands; timings (machine- and load-dependent) only a direction."""
    out = ["| quantity | ours (this run) | band in the handout |", "| --- | --- | --- |"]
    rows = {(r.get("strategy"), r.get("world_size")): r for r in mem.get("results") or []}
    one = rows.get(("one process", 1))
    for W in (2, 4):
        r = rows.get(("FSDP", W))
        if one and r:
            out.append(f"| FSDP peak / one process, W = {W} | {r['peak_bytes'] / one['peak_bytes']:.3f} | below "
                       f"{1 / W + 0.25:.2f} (1/W + 0.25: model states shrink as 1/W, activations and units do not) |")
    errs = [abs(r["model_error"]) for r in mem.get("results") or [] if r.get("model_error") is not None
            and str(r.get("strategy", "")).startswith("FSDP")]
    if errs:
        out.append(f"| FSDP rows' model error, largest | {100 * max(errs):.1f}% | within 20% |")
    opt = [(r["breakdown_at_peak"]["optim"], 8 * r["model"]["S"]) for r in mem.get("results") or []
           if r.get("strategy") == "FSDP" and (r.get("breakdown_at_peak") or {}).get("optim") and (r.get("model") or {}).get("S")]
    if opt:
        out.append(f"| FSDP optim MiB / 8 S | {max(abs(a / b - 1) for a, b in opt):.4f} off at most | exactly 1 (0.1%) |")
    ratios = [r["ratio"] for r in comm.get("bytes_per_step") or [] if r.get("strategy", "").startswith("FSDP")
              and "FSDP2" not in r.get("strategy", "") and r.get("ratio") is not None]
    if ratios:
        out.append(f"| FSDP counted / formula bytes | {min(ratios):.4f} to {max(ratios):.4f} | 1.000 (fp32, "
                   f"reshard on and off) |")
    for r in step.get("ratios") or []:
        if r.get("comparison", "").startswith("FSDP + prefetch / FSDP step"):
            out.append(f"| prefetch / no prefetch step time, {r.get('interconnect')} | {fmt(r.get('median'))} | "
                       f"{'below 1' if 'simulated' in str(r.get('interconnect')) else 'about 1 or below (noise on a loaded CPU)'} |")
    for r in step.get("results") or []:
        if r.get("strategy") == "FSDP + prefetch" and isinstance(r.get("exposed"), list) and r["exposed"]:
            fr = max(x.get("exposed_comm_fraction") or 0 for x in r["exposed"])
            out.append(f"| exposed comm with prefetching (fraction of the step), {r.get('interconnect')} | "
                       f"{fr:.2f} | below the no-prefetch row's |")
    weak = sorted((r["world_size"], r["peak_bytes"]) for r in scaling.get("results") or []
                  if r.get("scaling") == "weak" and r.get("strategy") == "FSDP")
    if weak:
        out.append(f"| weak scaling FSDP peak per rank, W = {', '.join(str(w) for w, _ in weak)} | "
                   f"{', '.join(f'{p / MIB:.1f}' for _, p in weak)} MiB | falls with W |")
    return out


def derive(results: Path) -> list[str]:
    """Per question, the numbers the key refers to (markdown lines)."""
    lines: list[str] = []
    mem, comm, step, scaling = (load(results, n) for n in ("memory", "comm", "step", "scaling"))
    gpt = (mem.get("config") or {}).get("gpt") or (comm.get("config") or {}).get("gpt")
    psi_root, psi = root_params(gpt) if gpt else (None, None)

    section(lines, "Q2 (arithmetic)")
    n, W = 1_000_003, 4
    padded = -(-n // W) * W
    lines += [f"- padded_numel = ceil({n:,} / {W}) x {W} = {padded:,}; shard_numel = {padded // W:,}; padding = "
              f"{padded - n} element = {4 * (padded - n)} bytes (fp32).",
              f"- worst case: W - 1 elements per unit, (W - 1) x 4 bytes in fp32 (12 bytes at W = 4)."]

    section(lines, "Q4 (the benchmark model's root unit)")
    if gpt:
        lines += [f"- the benchmark GPT {gpt}: {psi:,} parameters, root unit {psi_root:,} "
                  f"({100 * psi_root / psi:.1f}%: wte = the tied head, wpe, ln_f)."]
        for W in (2, 4):
            lines.append(f"- W = {W}: keeping the root unsharded saves Psi_root (W-1)/W = {psi_root * (W - 1) // W:,} "
                         f"elements sent per rank per step ({4 * psi_root * (W - 1) / W / MIB:.3f} MiB in fp32). It "
                         f"holds Psi_root x b = {4 * psi_root / MIB:.3f} MiB (fp32) from the end of the root's forward "
                         f"to the start of its backward (the loss only); the peak (start of backward, where the root is "
                         f"unsharded in both settings: U_p) does not change.")
    else:
        lines.append("- n/a (memory.json/comm.json: config.gpt missing)")

    section(lines, "Q8 (all-reduce vs reduce-scatter, the benchmark model)")
    if psi:
        for W in (2, 4):
            rs, ar = (W - 1) / W * 4 * psi, 2 * (W - 1) / W * 4 * psi
            lines.append(f"- W = {W}, Psi = {psi:,} fp32: reduce-scatter sends (W-1)/W x 4 Psi = {rs / MIB:.2f} MiB "
                         f"per rank, all-reduce 2 (W-1)/W x 4 Psi = {ar / MIB:.2f} MiB; after the all-reduce every rank "
                         f"holds the full gradient (4 Psi = {4 * psi / MIB:.2f} MiB) instead of its shard "
                         f"({4 * psi / W / MIB:.2f} MiB).")

    section(lines, "Q9 (global norm)")
    lines += ["- the reference all-reduces one fp32 scalar (the local sum of squares): 4 bytes of payload; a ring "
              "all-reduce sends 2 (W-1)/W x 4 bytes per rank (4 bytes at W = 2, 6 bytes at W = 4); its time is "
              "2 (W-1) alpha + 2 (W-1)/W x 4 / beta, i.e. latency."]

    section(lines, "Q10 and Q15 (memory.json)")
    rows = mem.get("results") or []
    if rows:
        lines.append("| strategy | W | optim MiB measured | 8 S MiB | peak MiB | model MiB | model error | U_p MiB | U_g MiB | U_end MiB | A MiB |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            model = r.get("model") or {}
            S = model.get("S") or model.get("psi")
            optim = (r.get("breakdown_at_peak") or {}).get("optim")
            mib = lambda key: fmt(model[key] / MIB) if model.get(key) is not None else "n/a"  # noqa: E731
            lines.append(f"| {r.get('strategy')} | {r.get('world_size')} | "
                         f"{fmt(optim / MIB if optim is not None else None)} | {fmt(8 * S / MIB if S else None)} | "
                         f"{fmt(r.get('peak_bytes', 0) / MIB)} | {fmt(model.get('peak_bytes', 0) / MIB)} | "
                         f"{fmt(100 * r['model_error'] if r.get('model_error') is not None else None, '%')} | "
                         f"{mib('unsharded_params_bytes')} | {mib('unsharded_grads_bytes')} | {mib('end_extra_bytes')} | "
                         f"{mib('activations_bytes')} |")
        errs = [(r.get("strategy"), r.get("world_size"), r["model_error"]) for r in rows
                if r.get("model_error") is not None and "FSDP" in str(r.get("strategy"))]
        if errs:
            lo, hi = min(errs, key=lambda e: e[2]), max(errs, key=lambda e: e[2])
            lines.append(f"- FSDP rows' model error ranges from {100 * lo[2]:+.1f}% ({lo[0]}, W = {lo[1]}) to "
                         f"{100 * hi[2]:+.1f}% ({hi[0]}, W = {hi[1]}).")
    else:
        lines.append("- n/a (memory.json: results missing)")

    section(lines, "Q14 (tied weights, the benchmark model)")
    if gpt:
        tied = gpt["vocab_size"] * gpt["n_embd"]
        lines.append(f"- the tied weight wte = lm_head: vocab x n_embd = {gpt['vocab_size']} x {gpt['n_embd']} = {tied:,} "
                     f"elements ({100 * tied / psi:.1f}% of Psi). Flattened once (in the root) it is all-gathered and "
                     f"reduce-scattered once: untied it would add 3 x {tied:,} x (W-1)/W elements per rank per step "
                     f"({3 * tied // 2:,} at W = 2) and 16 x {tied:,} / W bytes of model states.")

    section(lines, "Q16 (comm.json: the Models box's alpha-beta model fitted by least squares over all sizes, per W)")
    fits = alpha_beta_fit(comm)
    for W, f in fits.items():
        half = W * f["alpha_s"] * f["beta_Bps"] if f["alpha_s"] > 0 and f["beta_Bps"] == f["beta_Bps"] else None
        lines.append(f"- W = {W}: alpha = {f['alpha_s'] * 1e6:.0f} us, beta = {f['beta_Bps'] / 1e9:.3g} GB/s "
                     f"(all-gather, {f['n']} sizes, {f['sizes'][0]:,} to {f['sizes'][1]:,} B); latency = bandwidth "
                     f"term at N_1/2 = W alpha beta = {fmt(half / 2**10 if half else None, ' KiB')}; the highest bus "
                     f"bandwidth {fmt(f['best_busbw_gbps'])} GB/s at {f['best_size']:,} B.")
    if not fits:
        lines.append("- n/a (comm.json: collectives missing)")

    section(lines, "Q17 (comm.json: bytes per step, counted against the formula)")
    for r in comm.get("bytes_per_step") or []:
        counted, formula = r.get("total_bus_bytes"), r.get("formula_bytes")
        lines.append(f"- {r.get('strategy')}, W = {r.get('world_size')}: counted "
                     f"{fmt(int(counted) if counted is not None else None)} B, formula {r.get('formula')} = "
                     f"{fmt(int(formula) if formula is not None else None)} B, ratio "
                     f"{fmt(r.get('ratio'), digits=5)}; Psi = {fmt(r.get('psi_params'))} parameters"
                     + (f" ({r['note']})" if r.get("note") else ""))

    section(lines, "Q18 (step.json: prefetching; exposed communication as a fraction of the step)")
    for r in step.get("ratios") or []:
        if "prefetch" in r.get("comparison", "") and "/ FSDP step" in r.get("comparison", ""):
            lines.append(f"- {r['comparison']}, W = {r.get('world_size')}, {r.get('interconnect')}: median "
                         f"{fmt(r.get('median'))} over {len(r.get('per_round') or [])} round(s)")
    for r in step.get("results") or []:
        if r.get("strategy", "").startswith("FSDP") and r.get("exposed") is not None:
            phases = r["exposed"] if isinstance(r["exposed"], list) else [r["exposed"]]
            fr = sorted(x["exposed_comm_fraction"] for x in phases if isinstance(x, dict)
                        and x.get("exposed_comm_fraction") is not None)
            ms = sorted(x["exposed_comm_ms"] for x in phases if isinstance(x, dict) and x.get("exposed_comm_ms") is not None)
            total = sorted(x[k] for x in phases if isinstance(x, dict) for k in ("comm_ms", "total_comm_ms") if x.get(k) is not None)
            lines.append(f"- {r['strategy']}, W = {r.get('world_size')}, {r.get('interconnect')}: step "
                         f"{fmt(r.get('step_s', 0) * 1e3, ' ms')}, exposed communication "
                         f"{fmt(fr[0] if fr else None)} to {fmt(fr[-1] if fr else None)} of the step over the ranks "
                         f"({fmt(ms[0] if ms else None, ' ms')} to {fmt(ms[-1] if ms else None, ' ms')})"
                         + (f", total communication {fmt(total[0], ' ms')} to {fmt(total[-1], ' ms')}" if total else ""))

    section(lines, "Q19 (scaling.json, and the crossover W* of the Models box)")
    for r in scaling.get("results") or []:
        kind = f"{r['scaling']} scaling, global batch {r.get('global_batch')}, {r.get('batch_per_rank')} per rank; " \
            if r.get("scaling") else ""
        lines.append(f"- {kind}{r.get('strategy')}, W = {r.get('world_size')}: {fmt(r.get('psi_params'))} parameters, "
                     f"step {fmt(r.get('step_s', 0) * 1e3, ' ms')}, efficiency {fmt(r.get('efficiency'))}, peak "
                     f"{fmt(r.get('peak_bytes', 0) / MIB, ' MiB')} per rank ({fmt(r.get('peak_vs_base'))}x the smallest W)")
    base = next((r for r in scaling.get("results") or [] if r.get("scaling") == "weak" and r.get("strategy") == "FSDP"
                 and r.get("world_size") == 1), None)
    if base and fits and gpt:
        units = gpt["n_layer"] + 1
        for W, f in fits.items():
            alpha = max(f["alpha_s"], 0.0)  # a fit below 0 (noise at the large sizes): the bandwidth-only model
            w_star = crossover_w(alpha, f["beta_Bps"], base["step_s"], base["psi_params"], units)
            lines.append("- " + ('' if alpha == f["alpha_s"] else f"(alpha fitted {f['alpha_s'] * 1e6:.0f} us < 0: "
                          f"taken as 0) ") + f"W* from the W = {W} fit: T_comp = {base['step_s'] * 1e3:.0f} ms (weak FSDP, W = 1), "
                         f"U = {units} units, Psi = {base['psi_params']:,}, b = 4: a = 3 U alpha = "
                         f"{3 * units * alpha * 1e3:.1f} ms, c = 3 Psi b / beta = "
                         f"{3 * base['psi_params'] * 4 / f['beta_Bps'] * 1e3:.0f} ms, W* = {w_star:.2f}.")

    section(lines, "Bands (the handout's table of what good results look like)")
    lines += bands(mem, comm, step, scaling)

    section(lines, "Q20 (arithmetic: 13B parameters, AdamW, bf16 mixed precision, 8 GPUs of 80 GB)")
    psi13, W = 13e9, 8
    for name, per_rank in (("DDP", 16 * psi13), ("ZeRO-1", 4 * psi13 + 12 * psi13 / W), ("ZeRO-2", 2 * psi13 + 14 * psi13 / W),
                           ("FSDP (ZeRO-3)", 16 * psi13 / W)):
        lines.append(f"- {name}: {per_rank / 1e9:.2f} GB of model states per GPU -> "
                     f"{'does not fit' if per_rank > 80e9 else f'fits, {80 - per_rank / 1e9:.2f} GB left'}")

    section(lines, "Q22 (arithmetic: HSDP on 2 nodes x 4 GPUs, mesh (R, S) = (2, 4), fp32)")
    R, S = 2, 4
    W = R * S
    hsdp = W * 2 * (R - 1) / R / S  # x G bytes, summed over the GPUs
    fsdp = 2 * 3 * (W - 1) / W      # x P bytes: two ring links cross the nodes
    lines += [f"- HSDP: each GPU sends 2 (R-1)/R x G/S = {2 * (R - 1) / R / S:g} G bytes across nodes per step; "
              f"summed over the {W} GPUs {hsdp:g} G. Intra-node per GPU: 2 (S-1)/S P + (S-1)/S G = "
              f"{2 * (S - 1) / S:g} P + {(S - 1) / S:g} G.",
              f"- FSDP over all {W} GPUs, one ring ordered node by node: 2 of its {W} links cross the nodes, each "
              f"carrying 3 (W-1)/W P = {3 * (W - 1) / W:g} P per step: {fsdp:g} P in all.",
              f"- with fp32 parameters and gradients (P = G = 4 Psi): FSDP {4 * fsdp:g} Psi bytes, HSDP {4 * hsdp:g} Psi "
              f"bytes across nodes per step; ratio {fsdp / hsdp:.4g}. Model states per GPU: HSDP 16 Psi/{S} = "
              f"{16 / S:g} Psi, FSDP 16 Psi/{W} = {16 / W:g} Psi."]

    section(lines, "Q24 (arithmetic: CPU offload of GPT-2 small, Psi = 124e6, W = 8, PCIe 25 GB/s per GPU)")
    psi2, W, pcie = 124e6, 8, 25e9
    h2d, d2h = 2 * 4 * psi2 / W, 4 * psi2 / W
    lines += [f"- host to device: the fp32 shard, before each all-gather (forward and backward): 2 x 4 Psi/W = "
              f"{h2d / 1e6:.0f} MB; device to host: the fp32 gradient shard after each reduce-scatter: 4 Psi/W = "
              f"{d2h / 1e6:.0f} MB; in all 12 Psi/W = {(h2d + d2h) / 1e6:.0f} MB per GPU per step.",
              f"- at 25 GB/s: {(h2d + d2h) / pcie * 1e3:.2f} ms per step (H2D {h2d / pcie * 1e3:.2f} ms, D2H "
              f"{d2h / pcie * 1e3:.2f} ms). GPU memory saved per GPU: the model states 16 Psi/W = "
              f"{16 * psi2 / W / 1e9:.3f} GB (they live in CPU memory; the CPU runs AdamW)."]
    return lines


def tables(results: Path) -> list[str]:
    summary = results / "summary.md"
    if summary.exists():
        text = summary.read_text()
        return ["", "## The reference's benchmark tables (run_all.py summary, verbatim)", "",
                *text.split("\n", 1)[1].strip().replace("\n## ", "\n### ").splitlines()]
    out = []
    for name in ("memory", "comm", "step", "scaling"):
        md = results / f"{name}.md"
        if md.exists():
            out += ["", f"### {name}", "", *md.read_text().strip().splitlines()]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="run_all.py --quick: a smoke run (the staff test rejects it)")
    p.add_argument("--from", dest="source", type=Path,
                   help="use the results in this directory; run nothing (the staff test rejects it: nothing vouches "
                        "for which sources made them)")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    before = machine()
    fingerprint = sources_fingerprint()
    if args.source:
        results, command, seconds = args.source, f"(results taken from {args.source})", None
    else:
        results = Path(tempfile.mkdtemp(prefix="answer-key-"))
        command, seconds = run_benchmarks(results, not args.quick)
        if sources_fingerprint() != fingerprint:
            print("the benchmark or reference sources changed during the run: run again", file=sys.stderr)
            return 1
    after = machine()
    if (results / "quick").is_dir() and not (results / "memory.json").exists():
        results = results / "quick"  # run_all.py --quick writes into <out>/quick/
    env = load(results, "memory").get("environment", {})
    config = run_config(results)
    record = {"quick": config["quick"] or args.quick, "from_dir": bool(args.source),
              "world_sizes": config["world_sizes"], "sources_sha256": fingerprint,
              "fingerprinted": list(FINGERPRINTED)}
    lines = [
        "<!-- STAFF ANSWER KEY: never in the student release (staff/release.py refuses it). -->",
        "# Answer key numbers (generated: do not edit by hand)",
        "",
        "Regenerate: `python staff/answer_key/regenerate.py` (writes this file; see its docstring).",
        "",
        f"<!-- run: {json.dumps(record, sort_keys=True)} -->",
        "",
        f"- Machine: {before['cpu']}, {before['cores']} cores, no GPU; {before['os']}, Python {before['python']}, "
        f"torch {env.get('torch', '?')}, implementation `{env.get('fsdp_impl', '?')}`.",
        f"- Load average (1 min): {before['load_1min']} before, {after['load_1min']} after "
        f"(the machine was shared: timings are noisy).",
        f"- Command: `{command}`" + (f", {seconds:.0f} s" if seconds else "") + ".",
        f"- Sizes: {'--quick (tiny model): NOT what students run' if record['quick'] else 'the defaults (what students run)'}; "
        f"W per benchmark: " + ", ".join(f"{k} {v}" for k, v in config["world_sizes"].items()) + ".",
        f"- Sources fingerprint (code of {', '.join(FINGERPRINTED)}): `{fingerprint[:16]}`.",
    ]
    lines += derive(results)
    lines += tables(results)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}" + (f" ({seconds:.0f} s of benchmarks)" if seconds else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
