"""Regenerate the numbers of the writeup's answer key from the reference's own benchmark run (staff only).

    python staff/answer_key/regenerate.py             # --quick benchmarks (a few minutes on 2 cores), then NUMBERS.md
    python staff/answer_key/regenerate.py --full      # the benchmarks' default sizes (what students run; ~4 min quiet)
    python staff/answer_key/regenerate.py --from DIR  # no run: use the results already in DIR (run_all.py --out DIR)

It runs ``FSDP_IMPL=reference python benchmarks/run_all.py [--quick] --out <tmp>`` and writes
``staff/answer_key/NUMBERS.md``: the machine (CPU model, cores, load average before and after, torch), the exact
command, the four benchmark tables as the reference printed them, and per writeup question the numbers the key
(``staff/answer_key/ANSWER_KEY.md``) refers to, each computed here from the benchmark JSON or from the stated
arithmetic, never typed in. A field the benchmarks no longer write shows as "n/a" with its name, rather than
failing the whole run.

``--quick`` numbers come from a tiny model and one round: the memory and byte counts are exact (they do not depend
on the machine's load), the timings are noise. Grade students' timings on reasoning and internal consistency, not
against these values.
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


def run_benchmarks(out: Path, full: bool) -> tuple[str, float]:
    cmd = [sys.executable, "benchmarks/run_all.py", "--out", str(out)] + ([] if full else ["--quick"])
    env = dict(os.environ, FSDP_IMPL="reference")
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    shown = "FSDP_IMPL=reference python benchmarks/run_all.py" + ("" if full else " --quick") + " --out <a temporary dir>"
    return shown, time.monotonic() - t0


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


def derive(results: Path) -> list[str]:
    """Per question, the numbers the key refers to (markdown lines)."""
    lines: list[str] = []
    mem, comm, step, scaling = (load(results, n) for n in ("memory", "comm", "step", "scaling"))

    section(lines, "Q2 (arithmetic)")
    n, W = 1_000_003, 4
    padded = -(-n // W) * W
    lines += [f"- padded_numel = ceil({n:,} / {W}) x {W} = {padded:,}; shard_numel = {padded // W:,}; padding = "
              f"{padded - n} element = {4 * (padded - n)} bytes (fp32).",
              f"- worst case: W - 1 elements per unit, (W - 1) x 4 bytes in fp32 (12 bytes at W = 4)."]

    section(lines, "Q4 (the benchmark model's root unit)")
    gpt = (mem.get("config") or {}).get("gpt") or (comm.get("config") or {}).get("gpt")
    models = [("this run's model", gpt)] if gpt else []
    try:  # the model students benchmark with the defaults (bench_memory.py: --params 4e6 --layers 8 --block-size 32)
        sys.path.insert(0, str(ROOT))
        from fsdp_assignment.support.models import gpt_config_for_params
        cfg = gpt_config_for_params(int(4e6), n_layer=8, block_size=32, vocab_size=1021)
        models.append(("the default benchmark model (4e6 params, 8 layers)", dict(cfg.__dict__)))
    except Exception as err:  # noqa: BLE001 - a changed helper must not stop the key
        lines.append(f"- default model: n/a ({err})")
    for label, gpt in models:
        psi_root, psi = root_params(gpt)
        lines += [f"- {label}, GPT {gpt}: {psi:,} parameters, root unit {psi_root:,} "
                  f"({100 * psi_root / psi:.1f}%: wte = the tied head, wpe, ln_f)."]
        for W in (2, 4):
            lines.append(f"- W = {W}: keeping the root unsharded saves Psi_root (W-1)/W = {psi_root * (W - 1) // W:,} "
                         f"elements sent per rank per step ({4 * psi_root * (W - 1) / W / MIB:.3f} MiB in fp32), and "
                         f"costs the root's unsharded buffer from the end of forward to its backward: "
                         f"Psi_root x b = {4 * psi_root / MIB:.3f} MiB in fp32 ({2 * psi_root / MIB:.3f} MiB in bf16).")
    if not models:
        lines.append("- n/a (memory.json/comm.json: config.gpt missing)")

    section(lines, "Q7 (global norm)")
    lines += ["- the reference all-reduces one fp32 scalar (the local sum of squares): 4 bytes of payload; a ring "
              "all-reduce sends 2 (W-1)/W x 4 bytes per rank (6 bytes at W = 4), plus the per-message latency."]

    section(lines, "Q8 and Q12 (memory.json)")
    rows = mem.get("results") or []
    if rows:
        lines.append("| strategy | W | optim MiB measured | 8 Psi/W MiB | peak MiB | model MiB | model error |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            model = r.get("model") or {}
            psi = model.get("psi")
            W = r.get("world_size")
            optim = (r.get("breakdown_at_peak") or {}).get("optim")
            expect = 8 * psi / W if psi and W else None
            lines.append(f"| {r.get('strategy')} | {W} | {fmt(optim / MIB if optim is not None else None)} | "
                         f"{fmt(expect / MIB if expect else None)} | {fmt(r.get('peak_bytes', 0) / MIB)} | "
                         f"{fmt(model.get('peak_bytes', 0) / MIB)} | "
                         f"{fmt(100 * r['model_error'] if r.get('model_error') is not None else None, '%')} |")
    else:
        lines.append("- n/a (memory.json: results missing)")

    section(lines, "Q13 (comm.json: a least-squares fit of T = alpha + S / beta over the all-gather sizes)")
    coll = [c for c in comm.get("collectives") or [] if c.get("kind") == "all_gather" and c.get("seconds")]
    for W in sorted({c["world_size"] for c in coll}):
        pts = [(c["size"] * (W - 1) / W, c["seconds"]) for c in coll if c["world_size"] == W
               and c.get("interconnect", "").startswith("gloo")]
        if len(pts) >= 2:
            mx = sum(x for x, _ in pts) / len(pts)
            my = sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")
            alpha = my - slope * mx
            beta = 1 / slope / 1e9 if slope > 0 else float("nan")
            best = max((c for c in coll if c["world_size"] == W), key=lambda c: c.get("busbw_gbps", 0))
            lines.append(f"- W = {W}: alpha = {alpha * 1e6:.0f} us, beta = {beta:.3g} GB/s over {len(pts)} sizes "
                         f"({pts[0][0] * W / (W - 1):,.0f} to {pts[-1][0] * W / (W - 1):,.0f} B); best bus bandwidth "
                         f"{best.get('busbw_gbps', 0):.3g} GB/s at {best['size']:,} B. (A negative or absurd fit "
                         f"means the sizes are latency-bound or the machine was loaded: so is the student's.)")
    if not coll:
        lines.append("- n/a (comm.json: collectives missing)")

    section(lines, "Q14 (comm.json: bytes per step, counted against the formula)")
    for r in comm.get("bytes_per_step") or []:
        counted, formula = r.get("total_bus_bytes"), r.get("formula_bytes")
        lines.append(f"- {r.get('strategy')}, W = {r.get('world_size')}: counted "
                     f"{fmt(int(counted) if counted is not None else None)} B, formula {r.get('formula')} = "
                     f"{fmt(int(formula) if formula is not None else None)} B, ratio "
                     f"{fmt(r.get('ratio'), digits=5)}; Psi = {fmt(r.get('psi_params'))} parameters"
                     + (f" ({r['note']})" if r.get("note") else ""))

    section(lines, "Q15 (step.json: prefetching)")
    for r in step.get("ratios") or []:
        if "prefetch" in r.get("comparison", "") and "/ FSDP step" in r.get("comparison", ""):
            lines.append(f"- {r['comparison']}, W = {r.get('world_size')}, {r.get('interconnect')}: median "
                         f"{fmt(r.get('median'))} over {len(r.get('per_round') or [])} round(s)")
    for r in step.get("results") or []:
        if r.get("strategy", "").startswith("FSDP") and r.get("exposed") is not None:
            exposed = r["exposed"]
            phases = exposed if isinstance(exposed, list) else [exposed]
            fracs = sorted(x.get("exposed_comm_fraction") for x in phases
                           if isinstance(x, dict) and x.get("exposed_comm_fraction") is not None)
            frac = fracs[len(fracs) // 2] if fracs else None
            lines.append(f"- {r['strategy']}, W = {r.get('world_size')}, {r.get('interconnect')}: step "
                         f"{fmt(r.get('step_s', 0) * 1e3, ' ms')}, exposed communication {fmt(frac)} (median of the profiled "
                         f"ranks)")

    section(lines, "Q16 (scaling.json)")
    for r in scaling.get("results") or []:
        kind = f"{r['scaling']} scaling, global batch {r.get('global_batch')}, {r.get('batch_per_rank')} per rank; " \
            if r.get("scaling") else ""
        lines.append(f"- {kind}{r.get('strategy')}, W = {r.get('world_size')}: {fmt(r.get('psi_params'))} parameters, "
                     f"step {fmt(r.get('step_s', 0) * 1e3, ' ms')}, efficiency {fmt(r.get('efficiency'))}, peak "
                     f"{fmt(r.get('peak_bytes', 0) / MIB, ' MiB')} per rank ({fmt(r.get('peak_vs_base'))}x the smallest W)")

    section(lines, "Q17 (arithmetic: 13B parameters, AdamW, bf16 mixed precision, 8 GPUs of 80 GB)")
    psi, W = 13e9, 8
    for name, per_rank in (("DDP", 16 * psi), ("ZeRO-1", 4 * psi + 12 * psi / W), ("ZeRO-2", 2 * psi + 14 * psi / W),
                           ("FSDP (ZeRO-3)", 16 * psi / W)):
        lines.append(f"- {name}: {per_rank / 1e9:.2f} GB of model states per GPU -> "
                     f"{'does not fit' if per_rank > 80e9 else f'fits, {80 - per_rank / 1e9:.2f} GB left'}")

    section(lines, "Q19 (arithmetic: 2 nodes x 8 GPUs)")
    lines += ["- HSDP (shard over 8 in a node, replicate over 2 nodes): only the all-reduce of each GPU's gradient "
              "shard (Psi/8 elements) crosses nodes; a 2-replica all-reduce sends 2 (2-1)/2 x Psi/8 = Psi/8 elements "
              "per GPU per step (0.125 Psi; x 4 bytes with an fp32 reduce dtype).",
              "- FSDP over 16 GPUs: every all-gather and reduce-scatter spans both nodes; each GPU sends "
              "3 Psi x 15/16 = 2.81 Psi elements per step, and in a ring over 16 GPUs the two links that cross nodes "
              "each carry that much: about 22x the HSDP inter-node traffic per crossing link."]
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
    p.add_argument("--full", action="store_true", help="the benchmarks' default sizes instead of --quick")
    p.add_argument("--from", dest="source", type=Path, help="use the results in this directory; run nothing")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    before = machine()
    if args.source:
        results, command, seconds = args.source, f"(results taken from {args.source})", None
    else:
        results = Path(tempfile.mkdtemp(prefix="answer-key-"))
        command, seconds = run_benchmarks(results, args.full)
    after = machine()
    if (results / "quick").is_dir() and not (results / "memory.json").exists():
        results = results / "quick"  # run_all.py --quick writes into <out>/quick/
    env = load(results, "memory").get("environment", {})
    lines = [
        "<!-- STAFF ANSWER KEY: never in the student release (staff/release.py refuses it). -->",
        "# Answer key numbers (generated: do not edit by hand)",
        "",
        f"Regenerate: `python staff/answer_key/regenerate.py{' --full' if args.full else ''}` "
        f"(writes this file; see its docstring).",
        "",
        f"- Machine: {before['cpu']}, {before['cores']} cores, no GPU; {before['os']}, Python {before['python']}, "
        f"torch {env.get('torch', '?')}, implementation `{env.get('fsdp_impl', '?')}`.",
        f"- Load average (1 min): {before['load_1min']} before, {after['load_1min']} after "
        f"(the machine was shared: timings are noisy).",
        f"- Command: `{command}`" + (f", {seconds:.0f} s" if seconds else "") + ".",
        f"- Sizes: {'the defaults (what students run)' if args.full else '--quick (tiny model, W = 2, one round): memory and byte counts are exact, timings are noise'}.",
    ]
    lines += derive(results)
    lines += tables(results)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}" + (f" ({seconds:.0f} s of benchmarks)" if seconds else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
