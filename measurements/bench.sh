#!/usr/bin/env bash
# measurements/bench.sh BUILD_DIR [SECOND_BUILD_DIR] — `make bench`: throughput of the
# default BERT-mini (L=4 H=256 heads=4 F=1024 T=128, micro-batch 8 per rank,
# dropout 0.1), figures from one run each, not a timed test:
#   - one table: fp32 / bf16 / fp16 x stage 0 / 2 x N = 1, 2 ranks, tokens/s of
#     the median step and the share of it spent inside sgemm (the trainer's
#     timer around every sgemm call; cpu only), N=2 / N=1 (the same per-rank
#     batch, so 2.0 is perfect scaling) and stage 2 / stage 0 at N = 2;
#   - PyTorch (tests/torch_reference.py bench) on the same model, dropout
#     sites and AdamW, one thread on the per-rank batch: zero2 / PyTorch per
#     core. Measured back to back twice with zero2 (and SECOND_BUILD_DIR's
#     zero2, `make cpu`'s, when given), the mean of the two for each;
#   - PyTorch with 2 threads on the global batch of N = 2 beside zero2 N = 2;
#   - ZeRO-R at stage 2, N = 2: the step-time ratios recompute / keep and
#     offload / keep (notes/04 quotes these);
#   - portable mode (--portable: zero2's own gemm, notes/11) beside the
#     default mode, N = 1, stage 2: fp32 in the per-core rounds (each round
#     runs both), bf16 and fp16 right after their default run;
#   - ZeRO-Offload (--offload-optimizer cpu) beside the same run without it
#     (tokens/s and the optimizer step's milliseconds),
#     stage 2, N = 2, fp32 and bf16: three rounds, the order rotated each
#     round, the median of each run's median tokens/s; on the cpu device and
#     host are one memory, so the ratio is the cost of the extra copies and
#     the host's loops, not of PCIe.
# One OpenBLAS thread per rank. BENCH_STEPS (default 12) sets the step count.
set -eu
build=${1:-build}
second=${2:-}
steps=${BENCH_STEPS:-12}
work=$(mktemp -d /tmp/z2_bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
model=(--layers 4 --hidden 256 --heads 4 --intermediate 1024 --seq 128 --micro-batch 8 --dropout 0.1)
torch_model=(--layers 4 --hidden 256 --heads 4 --intermediate 1024 --seq 128 --dropout 0.1 --steps "$steps")

# zero2 BUILD NAME N ARGS...: one run, its JSON in $work/NAME.json.
zero2() {
  local dir=$1 name=$2 ranks=$3
  shift 3
  timeout 900 mpirun -n "$ranks" "$dir/train_bert_mini" "${model[@]}" --steps "$steps" --warmup 1 --quiet \
    --json "$work/$name.json" "$@"
}
# torch NAME THREADS BATCH: PyTorch's tokens/s into $work/NAME.tokens.
torch() {
  /usr/bin/python3 tests/torch_reference.py bench "${torch_model[@]}" --threads "$2" --batch "$3" |
    sed -n 's/^torch tokens\/s: //p' >"$work/$1.tokens"
}

for precision in fp32 bf16 fp16; do
  for stage in 0 2; do
    for ranks in 1 2; do
      zero2 "$build" "${precision}_s${stage}_n${ranks}" $ranks --stage $stage --precision $precision
      if [ $stage = 2 ] && [ $ranks = 1 ] && [ $precision != fp32 ]; then
        zero2 "$build" "${precision}_portable" 1 --stage 2 --precision $precision --portable
      fi
    done
  done
done
# Per core, back to back, twice: zero2 (both builds) and PyTorch with one thread.
for round in 1 2; do
  zero2 "$build" "percore_$round" 1 --stage 2
  zero2 "$build" "portable_$round" 1 --stage 2 --portable
  if [ -n "$second" ]; then zero2 "$second" "percore_second_$round" 1 --stage 2; fi
  torch "torch1_$round" 1 8
done
torch torch2 2 16
for activations in recompute offload; do
  zero2 "$build" "$activations" 2 --stage 2 --activations $activations
done

# Offload rounds: round r starts with offload in odd rounds, without it in even ones.
for round in 1 2 3; do
  for precision in fp32 bf16; do
    order="none cpu"; [ $((round % 2)) = 1 ] && order="cpu none"
    for offload in $order; do
      zero2 "$build" "offload_${precision}_${offload}_$round" 2 --stage 2 --precision $precision --offload-optimizer $offload \
        --wall-clock-breakdown
    done
  done
done

cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
cores=$(nproc)
kind=$(if ldd "$build/train_bert_mini" | grep -q libcudart; then echo nvcc; else echo g++; fi)
/usr/bin/python3 - "$work" "$build" "$kind" "$second" "$steps" "$cpu_model" "$cores" <<'PY'
import json, os, sys
work, build, kind, second, steps, cpu_model, cores = sys.argv[1:8]
def run(name): return json.load(open(os.path.join(work, name + ".json")))
def tokens(name): return run(name)["time"]["tokens_per_s_median"]
def share(name):
    d = run(name)
    return "   -" if d["device"] != "cpu" else f"{d['time']['gemm_share_median']:.2f}"
def torch(name): return float(open(os.path.join(work, name + ".tokens")).read())
device = run("fp32_s2_n1")["device"]
print(f"Machine: {cpu_model}, {cores} cores; zero2 on {device} ({build}/, built by {kind}); one OpenBLAS thread per rank")
print(f"BERT-mini L=4 H=256 heads=4 F=1024 T=128, micro-batch 8 per rank, dropout 0.1, {steps} steps;")
print("tokens/s of the median step, sgemm = share of the step inside sgemm (cpu; '-' on a GPU)")
print()
print(f"  {'precision':<10}{'stage':>5}{'N=1 tokens/s':>15}{'sgemm':>7}{'N=2 tokens/s':>15}{'sgemm':>7}{'N=2 / N=1':>11}")
for precision in ("fp32", "bf16", "fp16"):
    for stage in (0, 2):
        one, two = f"{precision}_s{stage}_n1", f"{precision}_s{stage}_n2"
        print(f"  {precision:<10}{stage:>5}{tokens(one):>15,.0f}{share(one):>7}{tokens(two):>15,.0f}{share(two):>7}"
              f"{tokens(two) / tokens(one):>11.3f}")
print("  stage 2 / stage 0 at N=2:   " + "   ".join(
    f"{p} {tokens(p + '_s2_n2') / tokens(p + '_s0_n2'):.3f}" for p in ("fp32", "bf16", "fp16")))
print()
mean = lambda values: sum(values) / len(values)
ours = mean([tokens(f"percore_{r}") for r in (1, 2)])
theirs = mean([torch(f"torch1_{r}") for r in (1, 2)])
print("Per core (N=1, one thread, fp32, stage 2, batch 8), back to back twice, the mean of each:")
label = lambda text: f"  {text:<30}"
print(label(f"zero2 ({build}/, {kind})") + f"{ours:>10,.0f} tokens/s")
if second:
    other = mean([tokens(f"percore_second_{r}") for r in (1, 2)])
    print(label(f"zero2 ({second}/, g++)") + f"{other:>10,.0f} tokens/s   {build}/ / {second}/ {ours / other:.3f}")
print(label("PyTorch (1 thread)") + f"{theirs:>10,.0f} tokens/s")
print(label("zero2 / PyTorch") + f"{ours / theirs:>10.3f}" + (f"   ({second}/: {other / theirs:.3f})" if second else ""))
torch2 = torch("torch2")
print(f"Two cores: zero2 fp32 stage 2 N=2 {tokens('fp32_s2_n2'):,.0f} tokens/s, PyTorch 2 threads batch 16 "
      f"{torch2:,.0f}: ratio {tokens('fp32_s2_n2') / torch2:.3f}")
print()
keep = run("fp32_s2_n2")["time"]["step_ms_median"]
recompute, offload = (run(n)["time"]["step_ms_median"] for n in ("recompute", "offload"))
print("ZeRO-R at stage 2, N=2: median step time by --activations")
print(f"  keep                        {keep:10.1f} ms")
print(f"  recompute                   {recompute:10.1f} ms   recompute / keep {recompute / keep:6.3f}")
print(f"  offload                     {offload:10.1f} ms   offload / keep   {offload / keep:6.3f}")
print()
print("Portable mode (--portable: zero2's own gemm), N=1, stage 2, beside the default mode (fp32: the per-core")
print("rounds' means; bf16, fp16: the run right after the table's):")
print(f"  {'precision':<10}{'default':>12}{'portable':>12}{'gemm':>7}{'portable / default':>21}")
pairs = [("fp32", mean([tokens(f"percore_{r}") for r in (1, 2)]), mean([tokens(f"portable_{r}") for r in (1, 2)]),
          mean([run(f"portable_{r}")["time"]["gemm_share_median"] for r in (1, 2)]) if device == "cpu" else None)]
for p in ("bf16", "fp16"):
    pairs.append((p, tokens(f"{p}_s2_n1"), tokens(f"{p}_portable"),
                  run(f"{p}_portable")["time"]["gemm_share_median"] if device == "cpu" else None))
for p, default, portable, gemm in pairs:
    print(f"  {p:<10}{default:>12,.0f}{portable:>12,.0f}{'   -' if gemm is None else f'{gemm:7.2f}'}"
          f"{portable / default:>21.3f}")
print()
print("ZeRO-Offload (--offload-optimizer cpu) beside no offload, stage 2, N=2: the median over 3 rotated rounds of")
print("each run's median tokens/s, and of its median optimizer step (--wall-clock-breakdown: the host loops and the")
print("copy up; the copy down ends each reduce-scatter, in backward). On the cpu device and host are one memory,")
print("so this is what the extra copies and buffers cost; the step's other phases are the same code either way.")
print(f"  {'precision':<10}{'tokens/s none':>14}{'cpu':>8}{'cpu / none':>12}{'optimizer ms none':>20}{'cpu':>8}"
      f"{'cpu - none':>12}")
median = lambda values: sorted(values)[len(values) // 2]
optimizer_ms = lambda name: median([step["optimizer_ms"] for step in run(name)["steps"]])
for p in ("fp32", "bf16"):
    none, cpu = (median([tokens(f"offload_{p}_{o}_{r}") for r in (1, 2, 3)]) for o in ("none", "cpu"))
    step_none, step_cpu = (median([optimizer_ms(f"offload_{p}_{o}_{r}") for r in (1, 2, 3)]) for o in ("none", "cpu"))
    print(f"  {p:<10}{none:>14,.0f}{cpu:>8,.0f}{cpu / none:>12.3f}{step_none:>20.2f}{step_cpu:>8.2f}"
          f"{step_cpu - step_none:>12.2f}")
PY
