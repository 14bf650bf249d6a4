"""tests/cli/deepspeed_configs.py — the learning rates and betas of DeepSpeed's schedulers against the runs'
--json summaries (tests/cli/deepspeed_configs.sh)."""
import json
import math
import os
import sys


def load(work, name):
    return json.load(open(os.path.join(work, name + ".json")))


def deepspeed(low, high, W, S, warmup_type, decays, steps):
    """Each step's rate, stepping a WarmupLR / WarmupDecayLR as DeepSpeed's engine does."""
    W = max(2, W)
    iteration, rates = -1, []
    for s in steps:
        if iteration < 0:
            gamma = 0.0
        elif iteration < W:
            gamma = math.log(iteration + 1) / math.log(W) if warmup_type == "log" else iteration / W
        elif decays:
            gamma = max(0.0, (S - iteration) / max(1.0, S - W))
        else:
            gamma = 1.0
        rates.append(low + (high - low) * gamma)
        if not s["skipped"]:
            iteration += 1
    return rates


def rates(work):
    """WarmupDecayLR and WarmupLR: each step's lr against deepspeed() above."""
    cases = [("decay_log", 1e-4, 2e-3, 3, 10, "log", True, 10), ("decay_part", 1e-4, 2e-3, 3, 10, "log", True, 4),
             ("decay_past", 1e-4, 2e-3, 3, 10, "log", True, 13), ("decay_linear", 1e-4, 2e-3, 3, 10, "linear", True, 10),
             ("constant_w1", 0.0, 2e-3, 1, 0, "log", False, 5), ("constant_w0", 0.0, 2e-3, 0, 0, "linear", False, 5),
             ("skips", 0.0, 1e-3, 4, 8, "linear", True, 12), ("flags_add", 0.0, 1e-3, 3, 6, "log", True, 6)]
    problems = []
    for name, low, high, W, S, kind, decays, count in cases:
        try:
            d = load(work, name)
        except Exception as e:
            problems.append(f"{name}: no run ({e})")
            continue
        steps = d["steps"]
        if len(steps) != count:
            problems.append(f"{name}: {len(steps)} steps, not {count}")
        want = deepspeed(low, high, W, S, kind, decays, steps)
        for s, rate in zip(steps, want):
            if abs(s["lr"] - rate) > 1e-12 * max(rate, 1e-300):
                problems.append(f"{name} step {s['step']}: lr {s['lr']} != {rate}")
    skips = load(work, "skips")["steps"]
    if not any(s["skipped"] for s in skips[2:-1]):
        problems.append("the fp16 run skipped no step between its third and its last")
    if load(work, "flags_add")["settings_origin"]["schedule"] != "flag:--warmup":
        problems.append("flags_add: the schedule's origin is not --warmup")
    print("ok" if not problems else "; ".join(problems[:4]))


def betas(work):
    """OneCycle's per-step betas reach AdamW (flat = fixed, cycling differs, offloaded = the device's)."""
    try:
        cycled, fixed, cycling, offload = (load(work, n) for n in ("flat_cycled", "flat_fixed", "cycling",
                                                                   "cycling_offload"))
    except Exception as e:
        print(f"no run ({e})")
        return
    problems = []
    if cycled["final_params_hash"] != fixed["final_params_hash"]:
        problems.append("betas (0.9, 0.99) per step != the optimizer's (0.9, 0.99)")
    if any(s["betas"] != [0.9, 0.99] for s in cycled["steps"]):
        problems.append("flat cycle: betas not (0.9, 0.99)")
    if cycling["final_params_hash"] == cycled["final_params_hash"]:
        problems.append("a cycling beta1 changed no bit")
    if offload["final_params_hash"] != cycling["final_params_hash"] or offload["offload_optimizer"] != "cpu":
        problems.append("offloaded AdamW with cycling betas != the device's")
    print("ok" if not problems else "; ".join(problems))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
