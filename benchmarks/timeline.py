"""The timeline picture of one training step (bench_step writes it as <out>/step_timeline.png).

For each strategy drawn (FSDP without and with prefetching, one above the other) and each rank, three lanes:

    compute          the training thread computing (blue) or blocked on a collective (pale red)
    all-gather       every all-gather in flight, from its call until it completed or was first waited for,
                     labelled with its unit (b0, b1, ... the blocks; R, gold and hatched: the root, = embeddings, ln_f, tied head)
    reduce-scatter   the same for reduce-scatters

and under them rank 0's memory over the step: live bytes, and the unsharded bytes (FSDP's unsharded flat
parameters, the storages it resizes; gradients are not in it; right axis: in blocks' worth, so "2" is two blocks
unsharded at once). The dashed lines end forward
and backward. Units are told apart by size (the root's flat parameter and a block's differ in size: in the benchmark
GPT a block is about twice the root) and by order (forward
gathers the blocks in order, backward in reverse; reduce-scatters come in reverse).
"""

from __future__ import annotations

import math

MiB = 1024 * 1024


def _unit_labels(comm: list[dict], units: dict, w: int) -> list[str]:
    full = {"root": math.ceil(units["root"] / w) * w * 4, "block": math.ceil(units["block"] / w) * w * 4}
    n = units["n_blocks"]
    seen = {"all_gather": 0, "reduce_scatter": 0}
    labels = []
    for c in comm:
        kind = min(full, key=lambda k: abs(full[k] - c["payload_bytes"]))
        if kind == "root" or c["kind"] not in seen:
            labels.append("R" if kind == "root" else "")
            continue
        k = seen[c["kind"]]
        seen[c["kind"]] += 1
        if c["kind"] == "all_gather":
            labels.append(f"b{k}" if k < n else f"b{2 * n - 1 - k}")
        else:
            labels.append(f"b{n - 1 - k}")
    return labels


def draw(data: dict, units: dict, w: int, title: str):
    """``data`` = {"interconnect": ..., "ranks": [{strategy: trace.timeline(...)} per rank]}; returns the figure."""
    import matplotlib.pyplot as plt

    strategies = list(data["ranks"][0])
    nr = len(data["ranks"])
    block_bytes = 4 * units["block"]
    heights = []
    for _ in strategies:
        heights += [1.0 + 0.55 * nr, 1.3]
    fig, axes = plt.subplots(len(heights), 1, figsize=(13, sum(heights) * 0.95 + 0.6),
                             gridspec_kw={"height_ratios": heights}, sharex=True)
    t_max = max(tl[s]["t_end"] for tl in data["ranks"] for s in strategies) * 1e3
    # Blocks take tab10's colours without its grey (index 7), so no block looks like another's neighbour or like
    # the root; the root is gold and hatched, unlike any block, and labelled "R" so that its narrow bars carry a label.
    block_colors = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]

    def color(label: str):
        if label == "R":
            return "#F0C040"
        return block_colors[int(label[1:]) % len(block_colors)] if label[1:].isdigit() else "#BBBBBB"

    for si, strategy in enumerate(strategies):
        ax, mx = axes[2 * si], axes[2 * si + 1]
        yticks, ylabels = [], []
        for r, ranks in enumerate(data["ranks"]):
            tl = ranks[strategy]
            base = (nr - 1 - r) * 3.6
            lanes = {"compute": base + 2.4, "all_gather": base + 1.2, "reduce_scatter": base}
            blocked = sorted((c["blocked"][0] * 1e3, c["blocked"][1] * 1e3) for c in tl["comm"]
                             if c["blocked"][1] > c["blocked"][0])
            ax.broken_barh([(0, tl["t_end"] * 1e3)], (lanes["compute"], 0.9), color="#4C72B0")
            ax.broken_barh([(a, b - a) for a, b in blocked], (lanes["compute"], 0.9), color="#F2B5B5")
            labels = _unit_labels(tl["comm"], units, w)
            label_end = {lane: -math.inf for lane in lanes}  # where the last label drawn in each lane ends (ms)
            bar_end = {lane: -math.inf for lane in lanes}  # where the last bar in each lane ends (ms)
            char_ms = t_max * 0.0055  # about one label character's width at fontsize 6 on this figure's x scale
            for c, label in zip(tl["comm"], labels):
                if c["kind"] not in lanes:
                    continue
                a, b = c["issue"] * 1e3, c["done"] * 1e3
                # two collectives of one kind in flight at once (the root's reduce-scatter beside b0's): the later
                # one takes the lane's lower half, so neither hides the other or its label
                y, height = lanes[c["kind"]], 0.9
                if bar_end[c["kind"]] - a > 0.25 * (b - a):  # a slight overlap (one ends as the next starts) is not
                    height = 0.36
                bar_end[c["kind"]] = max(bar_end[c["kind"]], b)
                ax.broken_barh([(a, max(b - a, t_max * 0.002))], (y, height), color=color(label),
                               edgecolor="black", linewidth=0.3, hatch="///" if label == "R" else None)
                half = (len(label) + 0.5) * char_ms / 2
                # a label needs its bar to be wide enough, and must not run into the previous one ("b0" + "R")
                if label and b - a > 2 * half * 0.8 and ((a + b) / 2 - half > label_end[c["kind"]] or height < 0.9):
                    ax.text((a + b) / 2, y + height / 2, label, ha="center", va="center", fontsize=6 if height == 0.9 else 5)
                    if height == 0.9:
                        label_end[c["kind"]] = (a + b) / 2 + half
            for phase in ("forward", "backward"):  # this rank's own phase ends, across its three lanes
                if phase in tl["phases"]:
                    ax.vlines(tl["phases"][phase] * 1e3, base - 0.1, base + 3.4, color="black", ls="--", lw=0.7)
            for lane, y in lanes.items():
                yticks.append(y + 0.45)
                ylabels.append(f"rank {r} {lane.replace('_', '-')}")
        ax.set_yticks(yticks, ylabels, fontsize=7)
        ax.set_title(f"{strategy}, W={w}, {data['interconnect']}: one step (dashed: end of forward, end of backward)",
                     fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        tl0 = data["ranks"][0][strategy]
        ts = [m[0] * 1e3 for m in tl0["memory"]]
        mx.step(ts, [m[1] / MiB for m in tl0["memory"]], where="post", color="#4C72B0", label="live MiB (rank 0)")
        mx.set_ylabel("live MiB", fontsize=8, color="#4C72B0")
        ux = mx.twinx()  # its own scale: how many units are unsharded at once, in blocks' worth
        ux.step(ts, [m[2] / block_bytes for m in tl0["memory"]], where="post", color="#C44E52",
                label="unsharded (rank 0), in blocks' worth")
        ux.set_ylabel("unsharded,\nin blocks", fontsize=7, color="#C44E52")
        ux.set_ylim(bottom=0)
        lines = mx.get_legend_handles_labels()[0] + ux.get_legend_handles_labels()[0]
        mx.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper right")
        mx.grid(alpha=0.3)
    axes[-1].set_xlabel("ms from the start of the step")
    axes[-1].set_xlim(0, t_max * 1.01)
    fig.suptitle(f"Timeline of one step, {title}: compute (blue) / waiting (pale red), all-gathers and "
                 f"reduce-scatters in flight per unit, memory", fontsize=10)
    fig.tight_layout()
    return fig
