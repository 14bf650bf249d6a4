"""tests/cli/zero_r.py — ZeRO-R's ledgers over the runs' --json summaries (tests/cli/zero_r.sh)."""
import glob
import json
import os
import sys


def ledgers(work):
    """The ledger rules, from the config alone (the tiny model: L 2, H 32, F 64, heads 2, T 16, B 2, dropout on),
    over every zero_r_N_STAGE_ACTIVATIONS_ALLOC.json in work."""
    L, H, F, NH, T, B, V = 2, 32, 64, 2, 16, 2, 260
    R, S, A = B * T, B * (T - 2), B * NH * T * T
    f = 4
    always = (2 * R + 2 * S + V + 1) * 4 + S * f                 # batch ints, per-row losses
    working_set = (7 * R * H + A + 2 * R * F + 4 * R) * f          # one block's activations
    scratch = (2 * R * H + R * max(2 * H, F) + A + A) * f          # its backward scratch (dropped probs: dropout on)
    backward_long = (V * H + R * H) * f                            # tied-decoder gradient, the flowing gradient
    checkpoint = R * H * f
    head = (7 * S * H + 2 * S + S * V) * f                         # the MLM head's phase
    embeddings = (R * H + 2 * R) * f + checkpoint                  # the embeddings' recomputation
    # one block (or the largest other phase) + two checkpoints
    bound = always + backward_long + 2 * checkpoint + max(working_set + scratch, head, embeddings)
    problems, count = [], 0
    for path in sorted(glob.glob(os.path.join(work, "zero_r_*.json"))):
        name = os.path.basename(path)[len("zero_r_"):-len(".json")]
        n, stage, activations, alloc = name.split("_")
        d = json.load(open(path))
        m = d["memory"]
        count += 1
        if activations == "offload" and m["activation_peak_bytes"] > bound:
            problems.append(f"{name}: offload activation peak {m['activation_peak_bytes']} > bound {bound}")
        if activations == "offload" and m["host_offload_peak_bytes"] != (L - 1) * checkpoint:
            problems.append(f"{name}: host offload peak {m['host_offload_peak_bytes']} != (L-1) checkpoints")
        if alloc == "arena" and (m["device_allocations_after_step1"] != 0 or m["device_allocations_per_step"] != 0):
            problems.append(f"{name}: the arena allocated after step 1 ({m['device_allocations_after_step1']})")
        if alloc in ("naive", "caching") and m["device_allocations_per_step"] <= 0:
            problems.append(f"{name}: {alloc} made no allocation in a step")
        if m["reserved_bytes"] > m["capacity_bytes"] or m["device_peak_bytes"] > m["reserved_bytes"]:
            problems.append(f"{name}: peak {m['device_peak_bytes']} <= reserved {m['reserved_bytes']}"
                            f" <= capacity {m['capacity_bytes']} fails")
        if abs(m["fragmentation"] - (1 - m["device_peak_bytes"] / m["reserved_bytes"])) > 1e-9:
            problems.append(f"{name}: fragmentation is not 1 - peak / reserved")
        if m["activation_peak_bytes"] != d["activation_peak_formula_bytes"]:
            problems.append(f"{name}: activation peak {m['activation_peak_bytes']}"
                            f" != formula {d['activation_peak_formula_bytes']}")
    ok = not problems and count == 81
    print(("ok" if ok else "bad") + f" {count} runs; offload bound {bound:,} bytes; " + "; ".join(problems[:4]))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
