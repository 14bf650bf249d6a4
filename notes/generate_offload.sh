#!/usr/bin/env bash
# notes/generate_offload.sh BUILD_DIR OUT_DIR — the measured block of notes/13 that is not `make bench`'s,
# one file per block in OUT_DIR, for notes/generate.sh (make notes) to paste; run alone to see it:
#   offload_ledger  BERT-mini at N = 2, stages 1 and 2, fp32 and bf16, with and without --offload-optimizer
#                   cpu: the device's and the host's model states beside their formulas, the host by category,
#                   and the final hash of each pair (the same)
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-$(mktemp -d)}
trainer="$build/train_bert_mini"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

flags="--steps 3 --quiet"
for precision in fp32 bf16; do
  for stage in 1 2; do
    for offload in none cpu; do
      timeout 300 mpirun -n 2 "$trainer" $flags --precision $precision --stage $stage --offload-optimizer $offload \
        --json "$work/${precision}_${stage}_$offload.json" >/dev/null
    done
  done
done
python3 - "$work" "$trainer" "$flags" >"$out/offload_ledger" <<'PY'
import json, sys
work, trainer, flags = sys.argv[1:]
run = lambda p, s, o: json.load(open(f"{work}/{p}_{s}_{o}.json"))
print(f"Measured by `make notes` (`OPENBLAS_NUM_THREADS=1 mpirun -n 2 {trainer} {flags} --precision P --stage S "
      f"--offload-optimizer O --json FILE`; the hashes depend on OpenBLAS's thread count, which splits its sums):")
print("BERT-mini at its default sizes, bytes per rank; each figure is the run's ledger, each formula `model_states_formula`")
print("or `offloaded_states_formula` of zero2.cu (the same the ledger prints beside it). Hash: the final parameters.")
print()
print("| precision | stage | offload | device model states | formula | host model states | formula "
      "| host: master, m + v, grads, params | final hash |")
print("|---|---|---|---|---|---|---|---|---|")
for p in ("fp32", "bf16"):
    for s in (1, 2):
        for o in ("none", "cpu"):
            d = run(p, s, o); m = d["memory"]
            host = (f"{m['host_master_bytes']:,}, {m['host_optimizer_bytes']:,}, {m['host_grads_bytes']:,}, "
                    f"{m['host_params_bytes']:,}") if o == "cpu" else "-"
            print(f"| {p} | {s} | {o} | {m['model_states_bytes']:,} | {m['model_states_formula']} = "
                  f"{m['model_states_formula_bytes']:,} | {m['host_model_states_bytes']:,} | "
                  f"{'16 Psi/N' if o == 'cpu' else '0'} = "
                  f"{m['host_model_states_formula_bytes']:,} | {host} | `{d['final_params_hash']}` |")
d = run("bf16", 2, "cpu")
print()
print(f"Psi_padded = {d['params_padded']:,} at N = 2. bf16 stage 2 without offload keeps "
      f"{run('bf16', 2, 'none')['memory']['model_states_bytes']:,} bytes of model states on the device; "
      f"with it, {d['memory']['model_states_bytes']:,} "
      f"({d['memory']['model_states_bytes'] / run('bf16', 2, 'none')['memory']['model_states_bytes']:.3f} of it), "
      f"and the host holds {d['memory']['host_model_states_bytes']:,}.")
PY
