"""Q15's scenario: the cluster the template's question states, and the arithmetic the key derives from it (no
results folder: the same numbers for every student).
"""

from __future__ import annotations

# Q15's cluster (the template states these; test_answer_key.py checks the template carries each). Writeup v5 asks
# no CPU offload and no ZeRO-2: no PCIe link here, and neither is computed.
SCENARIO = {"psi": 13e9, "nodes": 2, "gpus_per_node": 4, "gpu_gb": 80, "ag_bytes": 2, "rs_bytes": 4}


def add_scenario(v) -> None:
    """Q15: (a) model states per GPU for DDP, FSDP and HSDP; (b) the inter-node bytes of FSDP and HSDP, their ratio."""
    # Q15: the scenario
    sc = SCENARIO
    P, Wc, R, K = sc["psi"], sc["nodes"] * sc["gpus_per_node"], sc["nodes"], sc["gpus_per_node"]
    states = {"DDP": 16 * P, "FSDP": 16 * P / Wc, "HSDP": 16 * P / K}
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
    v.add("Q15", "q15_scenario", "the scenario as the question states it",
          f"Psi = {P / 1e9:.0f}B, {sc['nodes']} nodes x {sc['gpus_per_node']} GPUs of {sc['gpu_gb']} GB (W = {Wc}), "
          f"all-gathers in {ag}-byte bf16, reduce-scatters and all-reduces in {rs}-byte fp32")
