"""The key's memory numbers (Q2, Q5, Q6, Q9, Q12's levels, Q13's memory): padding arithmetic, the global norm's
bytes, and the measured peaks of memory.json against the memory model, with the noise rule on the differences.

Each function adds its values to ``v`` (values.Values) in the order NUMBERS.md prints them.
"""

from __future__ import annotations

from staff.answer_key.rules import _mib, dominant_term, resolved, students_row


def add_padding(v, rows: dict) -> None:
    """Q2: the padding of 1,000,003 elements and of the benchmark model at W = 2, 4; Q12: the unsharded curve's
    levels in blocks' worth (both read the FSDP row's model: the unit sizes)."""
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


def add_norm_bytes(v) -> None:
    """Q5: the bytes of the global norm's all-reduce (one fp32 scalar on a ring)."""
    # Q5: the global norm's bytes
    for W in (2, 4):
        v.add("Q5", f"q5_bytes_w{W}", f"ring all-reduce of one fp32 scalar at W = {W}, bytes sent per rank",
              f"{2 * (W - 1) / W * 4:g} bytes")


def add_peaks(v, mem: dict, rows: dict) -> None:
    """Q6 (optim against 8 S), Q9 (peaks, model error, (a)'s dominant term, (b)'s no-reshard difference) and Q13 (a)'s
    memory difference (2 blocks a unit against FSDP + prefetch). The conclusions carry writeup v5's part letters."""
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
        v.conclude("Q9", "q9_a_conclusion", "(a) the dominant term",
                   f"{top} ({branch} branch); another term of that branch earns the part only when argued from "
                   "the Models box; a term of the other branch does not count (its terms do not add to the peak)")

    def diff(a: str, b: str, W: int, q: str, name: str, part: str) -> None:
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
        v.conclude(q, name + "_conclusion", f"{part} {a} minus {b} at W = {W}", verdict)

    # (writeup v5 asks no prefetch difference in Q9: FSDP + prefetch against FSDP is not computed)
    diff("FSDP no-reshard", "FSDP", 4, "Q9", "q9_noreshard", "(b)")
    diff("FSDP + prefetch, 2 blocks/unit", "FSDP + prefetch", 4, "Q13", "q13_mem", "(a)")
    if r4:
        v.add("Q9", "q9_blk", "one block unit, 4 Psi_blk", _mib(4 * r4["model"]["n_block_unit"]))
    else:
        v.add("Q9", "q9_blk", "one block unit", "n/a")
