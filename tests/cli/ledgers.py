"""tests/cli/ledgers.py — the JSON summary's ledgers against formulas recomputed from the model's sizes
(tests/cli/ledgers.sh)."""
import json
import sys


def fp32(path, N, stage):
    """Model states and bytes sent of one fp32 run of the tiny model against the paper's formulas."""
    d = json.load(open(path))
    N, stage = int(N), int(stage)
    V, P, H, F, L, chunk = 260, 20, 32, 64, 2, 32           # the tiny model (tests/cli/common.sh); norm chunk 32
    block = [H*H, H, H*H, H, H*H, H, H*H, H, H, H, F*H, F, H*F, H, H, H]
    tensors = [V*H, P*H, H, H, H] + block * L + [H*H, H, H, H, V]
    psi = sum(tensors)
    problems = []
    if d["params"] != psi:
        problems.append("params %d != %d" % (d["params"], psi))
    # Padding: each tensor to a multiple of the chunk, each bucket to N chunks. The bucket grouping depends
    # on --bucket, so we take Psi_padded from the summary and check the rules it must obey instead.
    padded = d["params_padded"]
    aligned = sum((t + chunk - 1) // chunk * chunk for t in tensors)
    if padded < aligned or padded % (N * chunk) or padded - aligned >= len(tensors) * N * chunk:
        problems.append("params_padded %d inconsistent with %d aligned" % (padded, aligned))
    m = d["memory"]
    formula = {0: 16 * padded, 1: 8 * padded + 8 * padded // N, 2: 4 * padded + 12 * padded // N}[stage]
    if m["model_states_bytes"] != formula:
        problems.append("model states %d != formula %d" % (m["model_states_bytes"], formula))
    if m["model_states_formula_bytes"] != formula:
        problems.append("formula field %d != %d" % (m["model_states_formula_bytes"], formula))
    c = d["comm"]
    A = 4 // N
    moved = c["reduce_scatter_bytes_per_step"] + c["all_gather_bytes_per_step"] + c["all_reduce_bytes_per_step"]
    expect = (A + 1) * (N - 1) * padded // N * 4     # (A + 1) (N-1)/N Psi elements, 4 bytes each
    if moved != expect or c["formula_bytes_per_step"] != expect:
        problems.append("comm %d, formula field %d, expected %d" % (moved, c["formula_bytes_per_step"], expect))
    print("ok Psi=%d padded=%d model states %d comm %d" % (psi, padded, m["model_states_bytes"], moved)
          if not problems else "bad " + "; ".join(problems))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
