"""tests/cli/stages.py — the stage matrix's verdicts over the runs' --json summaries (tests/cli/stages.sh)."""
import json
import sys


def empty_batches(a_path, b_path):
    """Stages 0 and 2 with micro-batches that select nothing: equal bits, and a zero norm on such steps."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    zero = sum(1 for s in a["steps"] if s["loss"] == 0)
    zero_norm = all(s["grad_norm"] == 0 for d in (a, b) for s in d["steps"] if s["loss"] == 0)
    same = (a["final_params_hash"] == b["final_params_hash"]
            and [s["loss_bits"] for s in a["steps"]] == [s["loss_bits"] for s in b["steps"]])
    ok = same and zero_norm and 0 < zero < len(a["steps"])
    print(("ok" if ok else "bad") + " %d of %d steps selected nothing, their gradient norms %s; hashes %s %s"
          % (zero, len(a["steps"]), "all 0" if zero_norm else "NOT 0", a["final_params_hash"], b["final_params_hash"]))


def native_close(native_path, deterministic_path):
    """--collectives native against the deterministic bits: the worst relative loss difference <= 1e-4."""
    a, b = (json.load(open(p)) for p in (native_path, deterministic_path))
    worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a["steps"], b["steps"]))
    print(("ok" if worst <= 1e-4 else "bad") + " worst relative loss difference %.2e" % worst)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
