#!/usr/bin/env bash
# demos/superlinear.sh BUILD_DIR [LIMIT_BYTES [OUT_JSON]] — `make superlinear`: does the
# memory ZeRO frees buy throughput? The paper's claim (sections 1 and 10.3):
# with model states partitioned, each device holds a larger batch, and a
# larger batch runs each device closer to its peak, so throughput grows
# faster than the number of devices.
#
# The same bytes per rank (LIMIT_BYTES, default 100 MiB) for stages 0 and 2
# at N = 1, 2, 4. For each, the largest micro-batch that fits comes from the
# planner (train_bert_mini --plan --device-memory-limit: the arena's block,
# exact), and a run at that micro-batch in that limit checks it: five steps
# of the default BERT-mini with --activations recompute (the activations per
# sample are then small beside the model states, so the freed memory shows
# as batch). Throughput is the median of steps 2-5 (step 1 warms up):
#   aggregate tokens/s = N x micro-batch x seq / median step time
#   per rank           = aggregate / N
#   speedup            = aggregate / aggregate of stage 0 at N = 1
# Every rank computes a whole micro-batch on its own core; with more ranks
# than cores (N = 4 on a 2-core machine) the ranks share cores and per-rank
# throughput falls for that reason alone: the table says how many cores.
# With OUT_JSON, the rows also go there (notes/plot_capacity.py draws them).
set -eu
build=${1:-build}
limit=${2:-104857600}
out_json=${3:-}
trainer="$build/train_bert_mini"
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; exit 1; }
work=$(mktemp -d /tmp/z2_superlinear.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
# Z2_DEVICE=cuda (tests/gpu_check.sh): on the GPU, every rank sharing it over MPI.
model=(--activations recompute --steps 5 --log-every 5 --device "${Z2_DEVICE:-auto}")
started=$(date +%s)

"$trainer" --plan --plan-world-sizes 1,2,4 --device-memory-limit "$limit" "${model[@]}" --json "$work/plan.json" --quiet
rows=()
for stage in 0 2; do
  for ranks in 1 2 4; do
    batch=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([r['micro_batch'] for r in d['largest'] if r['stage'] == $stage and r['world_size'] == $ranks][0])" "$work/plan.json")
    if [ "$batch" -lt 1 ]; then rows+=("$stage $ranks 0 none"); continue; fi
    if ! timeout 900 mpirun -n "$ranks" "$trainer" "${model[@]}" --stage "$stage" --micro-batch "$batch" \
        --device-memory-limit "$limit" --quiet --json "$work/run_${stage}_${ranks}.json" > "$work/log" 2>&1; then
      echo "superlinear: stage $stage, N = $ranks, micro-batch $batch does not train in $limit bytes:" >&2
      cat "$work/log" >&2
      exit 1
    fi
    # One above must not fit: the planner's answer is the largest.
    above=fits
    timeout 900 mpirun -n "$ranks" "$trainer" "${model[@]}" --steps 1 --stage "$stage" --micro-batch $((batch + 1)) \
      --device-memory-limit "$limit" --quiet > "$work/log" 2>&1 || above=oom
    rows+=("$stage $ranks $batch $above")
  done
done

python3 - "$work" "$trainer" "$limit" "$(nproc)" "$(( $(date +%s) - started ))" "$out_json" "${rows[@]}" <<'PY'
import json, statistics, sys
work, trainer, limit, cores, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out_json, rows = sys.argv[6], [r.split() for r in sys.argv[7:]]
saved = []
print(f"Measured by `make superlinear` ({trainer} --activations recompute, the default BERT-mini, fp32,")
print(f"{limit:,} bytes per rank (--device-memory-limit), {cores} cores; median of steps 2-5).")
print("micro-batch: the largest the planner fits in the limit; \"+1\": one more, run for one step.")
print()
print("| stage | N | micro-batch | +1 | step (ms) | aggregate tokens/s | per rank | speedup vs stage 0, N = 1 |")
print("|---|---|---|---|---|---|---|---|")
base = None
for stage, ranks, batch, above in rows:
    stage, ranks, batch = int(stage), int(ranks), int(batch)
    if batch == 0:
        print(f"| {stage} | {ranks} | none fits | | | | | |"); continue
    d = json.load(open(f"{work}/run_{stage}_{ranks}.json"))
    ms = statistics.median(s["ms"] for s in d["steps"][1:])
    aggregate = d["tokens_per_step"] / (ms / 1000)
    base = base or aggregate
    print(f"| {stage} | {ranks} | {batch} | {'out of memory' if above == 'oom' else 'FITS'} | {ms:.0f} | "
          f"{aggregate:,.0f} | {aggregate / ranks:,.0f} | {aggregate / base:.2f} |")
    saved.append({"stage": stage, "world_size": ranks, "micro_batch": batch, "step_ms": ms, "limit_bytes": limit,
                  "aggregate_tokens_per_s": aggregate, "cores": cores, "one_more_fits": above != "oom"})
if out_json:
    json.dump({"rows": saved}, open(out_json, "w"), indent=1)
print()
print(f"Took {seconds} s on this machine.")
PY
