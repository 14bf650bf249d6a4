"""tests/cli/precision.py — mixed precision's verdicts over the runs' --json summaries (tests/cli/precision.sh)."""
import json
import os
import sys


def ledgers(work, precision):
    """The 16-bit ledgers from the config alone (the tiny model), over mixed_PRECISION_N_STAGE_1.json."""
    problems, count = [], 0
    for N in (1, 2, 4):
        for stage in (0, 1, 2):
            d = json.load(open(os.path.join(work, f"mixed_{precision}_{N}_{stage}_1.json")))
            count += 1
            psi = d["params_padded"]
            m = d["memory"]
            c = d["comm"]
            A = 4 // N
            # The paper's K = 12: 2-byte parameters and gradients, 12 bytes of fp32 master, m and v.
            formula = {0: 16 * psi, 1: 4 * psi + 12 * psi // N, 2: 2 * psi + 14 * psi // N}[stage]
            expect = {"params_bytes": 2 * psi, "grads_bytes": 2 * psi if stage < 2 else 2 * psi // N,
                      "master_bytes": 4 * psi if stage == 0 else 4 * psi // N,
                      "optimizer_bytes": 8 * psi if stage == 0 else 8 * psi // N,
                      "model_states_bytes": formula, "model_states_formula_bytes": formula,
                      # floor(log2 A) fp32 blocks of Psi/N (grad_accum_dtype fp32)
                      "accumulation_bytes": {1: 0, 2: 1, 4: 2}[A] * (psi // N) * 4}
            for key, value in expect.items():
                if m[key] != value:
                    problems.append(f"N={N} stage={stage} {key} {m[key]} != {value}")
            moved = c["reduce_scatter_bytes_per_step"] + c["all_gather_bytes_per_step"] + c["all_reduce_bytes_per_step"]
            wire = (A + 1) * (N - 1) * (psi // N) * 2       # (A + 1) (N-1)/N Psi elements, 2 bytes each
            if moved != wire or c["formula_bytes_per_step"] != wire:
                problems.append(f"N={N} stage={stage} comm {moved} (formula {c['formula_bytes_per_step']}) != {wire}")
            if d["precision"] != precision or m["precision"] != precision:
                problems.append(f"N={N} precision field")
    print(("ok" if not problems and count == 9 else "bad") + f" {count} runs"
          + (": " + "; ".join(problems[:4]) if problems else ""))


def overflow(*paths):
    """Five fp16 runs forced to overflow skip the same steps, and the scale follows DeepSpeed's update_scale."""
    runs = [json.load(open(p)) for p in paths]

    def key(d):
        return [s["skipped"] for s in d["steps"]], [s["loss_scale"] for s in d["steps"]], d["final_params_hash"]
    same = len(runs) == 5 and all(key(d) == key(runs[0]) for d in runs)
    # DeepSpeed's DynamicLossScaler.update_scale (loss_scaler.py), re-typed here.
    scale, hysteresis, window, delayed, last, problems = 2.0 ** 30, 2, 4, 2, -1, []
    d = runs[0]
    for it, s in enumerate(d["steps"]):
        if s["loss_scale"] != scale:
            problems.append(f"step {s['step']}: scale {s['loss_scale']} != {scale}")
        if s["skipped"]:
            if delayed == 1 or hysteresis == 1:
                scale = max(scale / 2, 1.0)
            else:
                hysteresis -= 1
            last = it
        elif (it - last) % window == 0:
            hysteresis = delayed
            scale *= 2
    skips = sum(s["skipped"] for s in d["steps"])
    grew = any(b["loss_scale"] > a["loss_scale"] for a, b in zip(d["steps"], d["steps"][1:]))
    ok = (same and not problems and d["skipped_steps"] == skips and 0 < skips < len(d["steps"]) and grew
          and d["loss_scale"] == scale)
    print(("ok" if ok else "bad") + f" {len(runs)} runs alike: {same}; {skips} of {len(d['steps'])} steps skipped, "
          f"the scale grew again: {grew}; final scale {d['loss_scale']:g} (DeepSpeed's rule: {scale:g}) "
          + "; ".join(problems[:3]))


def accuracy(work):
    """bf16 and fp16's mean loss of the last 10 steps within 1% of fp32's, and fp32's loss fell."""
    tail = {}
    for p in ("fp32", "bf16", "fp16"):
        d = json.load(open(os.path.join(work, f"accuracy_{p}.json")))
        losses = [s["loss"] for s in d["steps"]]
        tail[p] = sum(losses[-10:]) / 10
    fell = tail["fp32"] < 0.8 * json.load(open(os.path.join(work, "accuracy_fp32.json")))["steps"][0]["loss"]
    worst = max(abs(tail[p] - tail["fp32"]) / tail["fp32"] for p in ("bf16", "fp16"))
    print(("ok" if worst <= 0.01 and fell else "bad")
          + " last-10 mean loss fp32 %.4f bf16 %.4f fp16 %.4f, worst relative gap %.1e (<= 1e-2)"
          % (tail["fp32"], tail["bf16"], tail["fp16"], worst))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
