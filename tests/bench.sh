#!/usr/bin/env bash
# tests/bench.sh BUILD_DIR — `make bench`: throughput of the default BERT-mini,
# from one run each (figures, not a timed test):
#   - stage 0 and stage 2 at N = 2 (one OpenBLAS thread per rank), and their ratio;
#   - stage 2 at N = 2 with --activations recompute and offload: the
#     step-time ratios recompute / keep and offload / keep (ZeRO-R's price);
#   - stage 2 at N = 2 in bf16 and fp16 (--precision): tokens/s beside fp32's;
#   - PyTorch (tests/torch_reference.py bench) on the same model, the same
#     global batch (N x micro-batch sequences per step), the same dropout and the
#     same number of threads (2), and the ratio of ours to it.
# Tokens/s are the median step's (ours) and the mean over the timed steps
# (PyTorch's), after warm-up. BENCH_STEPS (default 12) sets the step count.
set -eu
build=${1:-build}
trainer="$build/train_bert_mini"
steps=${BENCH_STEPS:-12}
work=$(mktemp -d /tmp/z2_bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
model=(--layers 4 --hidden 256 --heads 4 --intermediate 1024 --seq 128 --micro-batch 8 --dropout 0.1)
N=2
for stage in 0 2; do
  timeout 900 mpirun -n $N "$trainer" "${model[@]}" --stage $stage --steps "$steps" --warmup 1 --quiet \
    --json "$work/stage$stage.json"
done
for precision in bf16 fp16; do
  timeout 900 mpirun -n $N "$trainer" "${model[@]}" --stage 2 --precision $precision --steps "$steps" --warmup 1 \
    --quiet --json "$work/$precision.json"
done
for activations in recompute offload; do
  timeout 900 mpirun -n $N "$trainer" "${model[@]}" --stage 2 --activations $activations --steps "$steps" --warmup 1 \
    --quiet --json "$work/$activations.json"
done
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
device=$(field "$work/stage0.json" "d['device']")
s0=$(field "$work/stage0.json" "d['time']['tokens_per_s_median']")
s2=$(field "$work/stage2.json" "d['time']['tokens_per_s_median']")
keep_ms=$(field "$work/stage2.json" "d['time']['step_ms_median']")
recompute_ms=$(field "$work/recompute.json" "d['time']['step_ms_median']")
offload_ms=$(field "$work/offload.json" "d['time']['step_ms_median']")
bf16=$(field "$work/bf16.json" "d['time']['tokens_per_s_median']")
fp16=$(field "$work/fp16.json" "d['time']['tokens_per_s_median']")
torch_line=$(/usr/bin/python3 tests/torch_reference.py bench --layers 4 --hidden 256 --heads 4 --intermediate 1024 \
  --seq 128 --batch $((N * 8)) --steps "$steps" --threads $N --dropout 0.1 | grep '^torch tokens/s:')
torch=${torch_line#torch tokens/s: }
python3 - "$s0" "$s2" "$torch" "$device" "$steps" "$keep_ms" "$recompute_ms" "$offload_ms" "$bf16" "$fp16" <<'PY'
import sys
s0, s2, torch = (float(x) for x in sys.argv[1:4]); device, steps = sys.argv[4], sys.argv[5]
keep, recompute, offload = (float(x) for x in sys.argv[6:9])
bf16, fp16 = (float(x) for x in sys.argv[9:11])
print(f"BERT-mini (L=4 H=256 heads=4 F=1024 T=128), global batch 16 sequences, {steps} steps, 2 ranks / 2 threads")
print(f"  zero2 stage 0 ({device}, N=2)   {s0:10,.0f} tokens/s")
print(f"  zero2 stage 2 ({device}, N=2)   {s2:10,.0f} tokens/s")
print(f"  stage 2 / stage 0           {s2 / s0:10.3f}")
print(f"  PyTorch (cpu, 2 threads)    {torch:10,.0f} tokens/s")
print(f"  zero2 stage 2 / PyTorch     {s2 / torch:10.3f}")
print(f"Mixed precision at stage 2, N=2: tokens/s by --precision ({device}; on the CPU 16-bit values are")
print(f"widened for sgemm and every kernel converts: the bytes shrink, the arithmetic does not)")
print(f"  fp32                        {s2:10,.0f} tokens/s")
print(f"  bf16                        {bf16:10,.0f} tokens/s   bf16 / fp32 {bf16 / s2:6.3f}")
print(f"  fp16                        {fp16:10,.0f} tokens/s   fp16 / fp32 {fp16 / s2:6.3f}")
print(f"ZeRO-R at stage 2, N=2: median step time by --activations")
print(f"  keep                        {keep:10.1f} ms")
print(f"  recompute                   {recompute:10.1f} ms   recompute / keep {recompute / keep:6.3f}")
print(f"  offload                     {offload:10.1f} ms   offload / keep   {offload / keep:6.3f}")
PY
