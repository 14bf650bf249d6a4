#!/usr/bin/env bash
# notes/figures.sh BUILD_DIR — `make figures`: regenerate the pictures in notes/figures/.
#   bert_mini_run.json  the summary (--json) of `make run`'s training: BERT-mini,
#                       stage 2, 2 ranks, the embedded corpus, default settings
#   bert_mini_loss.png  its loss and gradient norm per step (notes/plot_loss.py)
#   bert_mini_metrics.jsonl, bert_mini_eval.png   the same run with --eval-every 10: its
#                       --metrics file, and the train and held-out losses from it
#   bert_mini_run_bf16.json, bert_mini_run_fp16.json   the same training in bf16 and fp16
#   bert_mini_precision.png   the three loss curves in one figure (notes/plot_precision.py)
#   memory_*.csv        one step's allocator events (--memory-trace) of the default
#                       BERT-mini on one rank, per --activations x --alloc
#   memory_keep_vs_offload.png, memory_naive_vs_arena.png, memory_caching_vs_arena.png
#                       (notes/plot_memory.py)
#   capacity_plan.json, capacity_measured_*.json   --plan of the default BERT-mini at N = 1, 2,
#                       4, 8, 64 and one-step runs at N = 1, 2, 4 (their device peaks)
#   superlinear.json    demos/superlinear.sh's rows
#   capacity_by_stage.png, superlinear.png   (notes/plot_capacity.py)
#   timeline_bert_mini.png   one BERT-mini step (step 2) of --timeline on --device sim, 2 ranks, stage 2
#                       with overlap, and the same with --offload-optimizer cpu (notes/plot_timeline.py;
#                       notes/15-streams.md). Its two timelines (0.4 MB each) are not kept: a few seconds
#                       make them again (`make figures` alone: notes/figures.sh build timeline).
# The JSON and CSV files are kept beside the pictures, so the plot scripts can
# redraw them without training again.
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
export OPENBLAS_NUM_THREADS=1
# One BERT-mini step in the simulated device's modelled time, with and without ZeRO-Offload.
timeline_figure() {
  local scratch
  scratch=$(mktemp -d /tmp/z2_timeline.XXXXXX)
  for offload in none cpu; do
    timeout 900 mpirun -n 2 "$build/train_bert_mini" --device sim --stage 2 --steps 2 --warmup 1 --quiet \
      --offload-optimizer $offload --timeline "$scratch/$offload.json"
  done
  /usr/bin/python3 notes/plot_timeline.py notes/figures/timeline_bert_mini.png 2 \
    "BERT-mini, N = 2, stage 2, overlap: the reduce-scatters run under backward" "$scratch/none.json" \
    "the same with --offload-optimizer cpu: the step on the host, the shards over the host link" "$scratch/cpu.json"
  rm -rf "$scratch"
}
if [ "${2:-}" = timeline ]; then timeline_figure; exit; fi
timeout 900 mpirun -n 2 "$build/train_bert_mini" --stage 2 --quiet --json notes/figures/bert_mini_run.json
/usr/bin/python3 notes/plot_loss.py notes/figures/bert_mini_run.json notes/figures/bert_mini_loss.png
# The same run with --eval-every 10 (the data's last 5% held out) and its --metrics file.
timeout 900 mpirun -n 2 "$build/train_bert_mini" --stage 2 --quiet --eval-every 10 --metrics notes/figures/bert_mini_metrics.jsonl
/usr/bin/python3 notes/plot_loss.py notes/figures/bert_mini_metrics.jsonl notes/figures/bert_mini_eval.png
for precision in bf16 fp16; do
  timeout 1800 mpirun -n 2 "$build/train_bert_mini" --stage 2 --precision $precision --quiet \
    --json notes/figures/bert_mini_run_$precision.json
done
/usr/bin/python3 notes/plot_precision.py notes/figures/bert_mini_precision.png notes/figures/bert_mini_run.json \
  notes/figures/bert_mini_run_bf16.json notes/figures/bert_mini_run_fp16.json
for activations in keep recompute offload; do
  for alloc in arena naive caching; do
    timeout 300 "$build/train_bert_mini" --steps 1 --stage 2 --quiet --activations "$activations" --alloc "$alloc" \
      --memory-trace "notes/figures/memory_${activations}_${alloc}.csv"
  done
done
/usr/bin/python3 notes/plot_memory.py notes/figures notes/figures
# The paper's Figure 1 for BERT-mini: the plan, and what runs measure at N = 1, 2, 4.
"$build/train_bert_mini" --plan --plan-world-sizes 1,2,4,8,64 --quiet --json notes/figures/capacity_plan.json
for ranks in 1 2 4; do
  for stage in 0 1 2; do
    timeout 600 mpirun -n $ranks "$build/train_bert_mini" --steps 1 --stage $stage --quiet \
      --json notes/figures/capacity_measured_${stage}_${ranks}.json
  done
done
demos/superlinear.sh "$build" 104857600 notes/figures/superlinear.json > /dev/null
/usr/bin/python3 notes/plot_capacity.py notes/figures/capacity_plan.json notes/figures notes/figures/superlinear.json \
  notes/figures
timeline_figure
