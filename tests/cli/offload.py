"""tests/cli/offload.py — ZeRO-Offload's ledger and checkpoints against the runs' files (tests/cli/offload.sh)."""
import json
import os
import sys


def ledger(*paths):
    """The host's bytes = 16 Psi/N, the device's model states = the working parameters (stage 1: and their
    gradient), measured and by formula; the host's categories add up."""
    problems = []
    for path in paths:
        d = json.load(open(path))
        m, N, psi, stage = d["memory"], d["world_size"], d["params_padded"], d["stage"]
        work_bytes = 4 if d["precision"] == "fp32" else 2
        device = (2 if stage == 1 else 1) * work_bytes * psi  # the working parameters (stage 1: and its gradient)
        if not (m["offload_optimizer"]
                and m["host_model_states_bytes"] == m["host_model_states_formula_bytes"] == 16 * psi // N):
            problems.append(f"{path}: host {m['host_model_states_bytes']} formula"
                            f" {m['host_model_states_formula_bytes']} want {16 * psi // N}")
        if not (m["model_states_bytes"] == m["model_states_formula_bytes"] == device):
            problems.append(f"{path}: device {m['model_states_bytes']} formula {m['model_states_formula_bytes']}"
                            f" want {device}")
        if (m["host_master_bytes"] + m["host_optimizer_bytes"] + m["host_grads_bytes"] + m["host_params_bytes"]
                != m["host_model_states_bytes"]):
            problems.append(f"{path}: the host categories do not add up")
    print("ok %d runs" % len(paths) if not problems else "; ".join(problems[:3]))


def plan_rows(path, precision):
    """--plan with offload: every row's host bytes = 16 Psi/N (0 at stage 0) = its formula, the device's model
    states = their formula, and stage 2's device holds the working parameters alone."""
    d = json.load(open(path))
    ok = all(r["host_model_states_bytes"] == r["host_model_states_formula_bytes"]
             == (16 * r["psi_padded"] // r["world_size"] if r["stage"] else 0)
             and r["model_states_bytes"] == r["model_states_formula_bytes"]
             and (r["stage"] != 2 or r["model_states_bytes"] == r["params_bytes"]) for r in d["plan"])
    print("ok" if ok else f"bad {precision}: " + str([(r["stage"], r["world_size"], r["host_model_states_bytes"],
                                                       r["model_states_bytes"]) for r in d["plan"]]))


def without_run_id(value):
    """The index without its run_id, and without the offload setting, which a resumed run continues with
    (notes/13)."""
    if isinstance(value, dict):
        return {k: without_run_id(v) for k, v in value.items() if k not in ("run_id", "offload_optimizer")}
    return [without_run_id(v) for v in value] if isinstance(value, list) else value


def same_checkpoint(a, b):
    """Two step directories: the same tensor files, byte for byte, and the same index but its run_id."""
    tensors = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    same = bool(tensors) and all(open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read()
                                 for f in tensors)
    index = [json.load(open(os.path.join(d, "index.json"))) for d in (a, b)]
    print("ok %d tensor files" % len(tensors) if same and without_run_id(index[0]) == without_run_id(index[1])
          else "differ")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
