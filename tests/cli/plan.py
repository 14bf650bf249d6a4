"""tests/cli/plan.py — the memory plan (train_bert_mini --plan) against real runs (tests/cli/plan.sh)."""
import json
import resource
import subprocess
import sys


def against_ledger(trainer, work, *tiny):
    """Ten (precision, activations, extra flags) cases, each planned once for N = 1, 2, 4 and run at every
    (stage, N): every category of the plan equals the measured ledger, to the byte. Prints "ok COMPARED"."""
    tiny = [a for a in tiny if a != "--quiet"]
    cases = [("fp32", "keep", ["--accum", "1"]), ("fp32", "recompute", ["--accum", "4", "--alloc", "naive"]),
             ("fp32", "offload", ["--accum", "2", "--overlap", "0"]), ("bf16", "keep", ["--accum", "4"]),
             ("bf16", "recompute", ["--accum", "1", "--overlap", "0"]),
             ("bf16", "offload", ["--accum", "2", "--alloc", "naive"]),
             ("fp16", "keep", ["--accum", "2", "--alloc", "caching"]), ("fp16", "recompute", ["--accum", "2"]),
             ("fp16", "offload", ["--accum", "4", "--config", work + "/plan_accum16.json"]),
             # DeepSpeed's batch rule: train_batch_size 8 of micro-batches of 2 is A = 4 / N at each N
             ("fp32", "recompute", ["--config", work + "/plan_batch.json"])]
    json.dump({"data_types": {"grad_accum_dtype": "fp16"}}, open(work + "/plan_accum16.json", "w"))
    json.dump({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, open(work + "/plan_batch.json", "w"))
    keys = ["params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes", "accumulation_bytes", "staging_bytes",
            "activation_peak_bytes", "bookkeeping_bytes", "model_states_bytes", "device_peak_bytes"]
    problems, compared = [], 0
    for precision, activations, extra in cases:
        flags = tiny + ["--precision", precision, "--activations", activations, "--steps", "1"] + extra
        plan_file = f"{work}/plan.json"
        out = subprocess.run([trainer, "--plan", "--plan-world-sizes", "1,2,4", "--json", plan_file, "--quiet"] + flags,
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            problems.append(f"--plan {precision} {activations}: {out.stderr[:200]}")
            continue
        plan = {(r["stage"], r["world_size"]): r for r in json.load(open(plan_file))["plan"]}
        for stage in (0, 1, 2):
            for ranks in (1, 2, 4):
                run = subprocess.run(["mpirun", "-n", str(ranks), trainer, "--stage", str(stage), "--quiet", "--json",
                                      f"{work}/run.json"] + flags, capture_output=True, text=True, timeout=120)
                label = f"{precision} {activations} {' '.join(extra[:4])} stage {stage} N {ranks}"
                if run.returncode != 0:
                    problems.append(f"{label}: the run failed: {run.stderr[:200]}")
                    continue
                ledger, row = json.load(open(f"{work}/run.json"))["memory"], plan[(stage, ranks)]
                for key in keys + (["reserved_bytes"] if "--alloc" not in extra else []):
                    planned = row["arena_block_bytes" if key == "reserved_bytes" else key]
                    compared += 1
                    if planned != ledger[key]:
                        problems.append(f"{label}: {key} planned {planned}, measured {ledger[key]}")
    print(f"ok {compared}" if not problems else "; ".join(problems[:6]) + f" ({len(problems)} in all)")


def peak_of(*command):
    """The peak resident bytes of the command (getrusage of the child), or "failed"."""
    status = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 if status == 0 else "failed")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
