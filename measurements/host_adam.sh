#!/usr/bin/env bash
# measurements/host_adam.sh BUILD_CPU [ROUNDS] — ZeRO-Offload's host step beside
# DeepSpeed's, in one run (`make bench` prints it last; `make bench-host-adam`
# alone; `make check-peer PEER=deepspeed` after its checks):
#   - AdamW alone: zero2's host loop (BUILD_CPU/host_adam_bench: the engine's
#     AdamWByChunk through Compute::for_each_at on the host) and
#     DeepSpeedCPUAdam.step (measurements/deepspeed_cpu_adam.py, in
#     .venv-deepspeed when it exists) on 10M and 50M parameters, at 1 and 2
#     threads, alternating in each of ROUNDS rounds (default 5; the order
#     turned round every other round); the median over the rounds of each
#     run's fastest of 30 steps (a neighbour on a shared machine only adds
#     time), as ms, as GB/s of the 28 bytes per parameter a step
#     reads and writes, zero2 / DeepSpeed, and each one's 2 threads / 1 thread;
#   - the whole offloaded optimizer step of the trainer (--wall-clock-breakdown:
#     the norm, the clip, AdamW and the copies), BERT-mini at N = 1, bf16,
#     stage 2, at --host-threads 1 and 2, beside the same run without offload,
#     and again at 1 and 2 with a busy loop on one core.
# Without DeepSpeed's venv the DeepSpeed columns say so (make check-peer
# PEER=deepspeed builds it, 5.3 GB). Not a test: figures, side by side.
set -eu
build=${1:-build-cpu}
rounds=${2:-5}
work=$(mktemp -d /tmp/z2_host_adam.XXXXXX)
busy=""  # the busy loop's pid while it runs (the trap ends it if this script stops early)
trap 'rm -rf "$work"; [ -z "$busy" ] || kill "$busy" 2>/dev/null' EXIT
export OPENBLAS_NUM_THREADS=1
venv=${DEEPSPEED_VENV:-.venv-deepspeed}
have_deepspeed=0
[ -x "$venv/bin/python" ] && have_deepspeed=1

# zero2_runs / deepspeed_run ELEMENTS THREADS: one timing line each into adam.txt (zero2: fp32 and bf16).
zero2_runs() {
  for precision in fp32 bf16; do "$build/host_adam_bench" "$1" "$2" $precision >>"$work/adam.txt"; done
}
deepspeed_run() {
  [ $have_deepspeed = 1 ] || return 0
  # DeepSpeedCPUAdam JIT-builds its op on first use (~80 s, cached after).
  OMP_NUM_THREADS=$2 DS_ACCELERATOR=cpu "$venv/bin/python" measurements/deepspeed_cpu_adam.py "$1" "$2" \
    2>"$work/deepspeed.err" | grep '^deepspeed ' >>"$work/adam.txt" ||
    { echo "DeepSpeedCPUAdam failed:"; tail -n 5 "$work/deepspeed.err"; exit 1; }
}
# Zero2's first in odd rounds, DeepSpeed's first in even ones.
for round in $(seq 1 "$rounds"); do
  for threads in 1 2; do
    for elements in 10000000 50000000; do
      if [ $((round % 2)) = 1 ]; then
        zero2_runs $elements $threads; deepspeed_run $elements $threads
      else
        deepspeed_run $elements $threads; zero2_runs $elements $threads
      fi
    done
  done
done

# The trainer's whole optimizer step, N = 1 (the host's threads are this rank's cores); last, 1 and 2
# threads with a busy loop beside them on one core (more threads than free cores: notes/13).
step_run() {  # NAME FLAGS...
  local name=$1
  shift
  "$build/train_bert_mini" --steps 12 --warmup 1 --stage 2 --precision bf16 "$@" --wall-clock-breakdown --quiet \
    --json "$work/step_${name}_$round.json" >/dev/null
}
for round in $(seq 1 "$rounds"); do
  step_run none --offload-optimizer none
  step_run cpu_1 --offload-optimizer cpu --host-threads 1
  step_run cpu_2 --offload-optimizer cpu --host-threads 2
  sh -c 'while :; do :; done' &
  busy=$!
  step_run busy_1 --offload-optimizer cpu --host-threads 1
  step_run busy_2 --offload-optimizer cpu --host-threads 2
  kill "$busy"
  busy=""
done

/usr/bin/python3 - "$work" "$rounds" "$have_deepspeed" "$build" <<'PY'
import json, os, sys
work, rounds, have_deepspeed, build = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
median = lambda values: sorted(values)[len(values) // 2]
runs = {}
for line in open(os.path.join(work, "adam.txt")):
    who, precision, elements, threads, ms, touched = line.split()
    runs.setdefault((who, precision, int(elements), int(threads)), []).append((float(ms), int(touched)))
def ms(who, precision, elements, threads):
    found = runs.get((who, precision, elements, threads))
    return (median([m for m, _ in found]), found[0][1]) if found else (None, None)
cpu = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].split("\n")[0].strip()
print(f"ZeRO-Offload's host AdamW alone: zero2 ({build}/host_adam_bench: zero2.h's AdamWByChunk on the host's")
print("threads) beside DeepSpeedCPUAdam.step (deepspeed 0.16.9, fp32 parameter and gradient, as its offload keeps")
print(f"them); {cpu}, {os.cpu_count()} cores; the median over {rounds} alternating rounds of each run's fastest of")
print("30 steps. GB/s = 28 bytes per parameter (param or master, m, v read and written; the gradient read; bf16:")
print("2 of gradient, 2 of rounded copy written) / the step's time. ratio = DeepSpeed's ms / zero2's (above 1:")
print("zero2 faster); scaling = 1 thread's ms / 2 threads', from the medians and from each run's best round.")
print(f"  {'parameters':>11}{'threads':>8}{'zero2 fp32 ms':>15}{'GB/s':>7}{'bf16 ms':>9}{'GB/s':>7}"
      f"{'DeepSpeed ms':>14}{'GB/s':>7}{'ratio fp32':>12}{'bf16':>6}")
for elements in (10000000, 50000000):
    for threads in (1, 2):
        fp32, touched = ms("zero2", "fp32", elements, threads)
        bf16, _ = ms("zero2", "bf16", elements, threads)
        theirs, _ = ms("deepspeed", "fp32", elements, threads)
        gbs = lambda t: touched / t / 1e6
        row = f"  {elements:>11,}{threads:>8}{fp32:>15.2f}{gbs(fp32):>7.1f}{bf16:>9.2f}{gbs(bf16):>7.1f}"
        row += (f"{theirs:>14.2f}{gbs(theirs):>7.1f}{theirs / fp32:>12.2f}{theirs / bf16:>6.2f}" if theirs
                else f"{'not run':>14}")
        print(row)
# Scaling from the medians, and from each run's best round: a shared machine's memory bandwidth and
# second core come and go, so the best round says what 2 threads reach when both are there.
best = lambda who, precision, elements, threads: min(m for m, _ in runs[(who, precision, elements, threads)])
for label, of in (("median rounds", lambda *key: ms(*key)[0]), ("best rounds  ", best)):
    print(f"  scaling 1 -> 2 threads, {label}: " + "; ".join(
        f"{elements // 1000000}M zero2 fp32 {of('zero2', 'fp32', elements, 1) / of('zero2', 'fp32', elements, 2):.2f}"
        f", bf16 {of('zero2', 'bf16', elements, 1) / of('zero2', 'bf16', elements, 2):.2f}"
        + (f", DeepSpeed {of('deepspeed', 'fp32', elements, 1) / of('deepspeed', 'fp32', elements, 2):.2f}"
           if have_deepspeed else "") for elements in (10000000, 50000000)))
if not have_deepspeed:
    print("  DeepSpeed: not run (no .venv-deepspeed here; `make check-peer PEER=deepspeed` builds it)")
print()
def step(run):
    data = [json.load(open(os.path.join(work, f"step_{run}_{r}.json"))) for r in range(1, rounds + 1)]
    return median([median([s["optimizer_ms"] for s in d["steps"]]) for d in data]), data[0]
none, first = step("none")
one, two, busy_one, busy_two = (step(name)[0] for name in ("cpu_1", "cpu_2", "busy_1", "busy_2"))
print(f"The trainer's whole optimizer step (--wall-clock-breakdown), BERT-mini ({first['params']:,} parameters), N=1,")
print(f"bf16, stage 2, 12 steps; the median over {rounds} rounds of each run's median step:")
print(f"  without offload (the cpu device's loops)   {none:7.2f} ms")
print(f"  --offload-optimizer cpu --host-threads 1   {one:7.2f} ms   / without {one / none:.2f}")
print(f"  --offload-optimizer cpu --host-threads 2   {two:7.2f} ms   / without {two / none:.2f}   1 thread / 2 {one / two:.2f}")
print("With a busy loop on one of the cores (more threads than free cores):")
print(f"  --offload-optimizer cpu --host-threads 1   {busy_one:7.2f} ms")
print(f"  --offload-optimizer cpu --host-threads 2   {busy_two:7.2f} ms   1 thread / 2 {busy_one / busy_two:.2f}")
PY
