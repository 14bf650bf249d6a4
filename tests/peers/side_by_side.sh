#!/usr/bin/env bash
# tests/peers/side_by_side.sh [BUILD_DIR] — zero2 and DeepSpeed side by side on this machine's CPU, as
# `make check-peer PEER=deepspeed` prints it after its check (and `make notes` can paste it):
#
#   - tokens/s of zero2 --stage 2 and DeepSpeed ZeRO-2, and of stage 0 of each: the default BERT-mini
#     (L 4, H 256, 4 heads, F 1024, T 128, micro-batch 8 per rank), N = 2, fp32, dropout 0.1, one thread
#     per rank, the same batches (zero2's, from a trace of its own run) and learning rates. SIDE_ROUNDS
#     rounds (3), each running the four configurations once in an order that rotates by one per round;
#     per configuration min / median / max, and zero2 / DeepSpeed within each round;
#   - peak resident memory per rank, and how much of DeepSpeed's is its imports;
#   - bytes sent per rank per step: DeepSpeed's comms logger beside zero2's ledger (--json's comm);
#   - DeepSpeed's memory estimator beside the model-state bytes zero2's run allocated (= --plan's).
# Every derived number is printed with its formula. SIDE_STEPS (16) steps a run; tokens/s of a run is
# N x B x T over the median of its steps 2 .. SIDE_STEPS (step 1 makes the buffers in both).
# Needs .venv-deepspeed (DEEPSPEED_VENV overrides; tests/peers/check_peer.sh makes it).
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build}
python=${DEEPSPEED_VENV:-.venv-deepspeed}/bin/python
steps=${SIDE_STEPS:-16}
rounds=${SIDE_ROUNDS:-3}
[ -x "$build/train_bert_mini" ] || { echo "no $build/train_bert_mini: build it first (make)"; exit 1; }
"$python" -c 'import deepspeed' >/dev/null 2>&1 || { echo "no DeepSpeed in $python: make check-peer PEER=deepspeed makes it"; exit 1; }
work=$(mktemp -d /tmp/z2_side.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
model=(--layers 4 --hidden 256 --heads 4 --intermediate 1024 --seq 128 --micro-batch 8 --dropout 0.1)

# The batches both train on: zero2's run written down (untimed); DeepSpeed reads them and their rates.
timeout 600 mpirun -n 2 "$build/train_bert_mini" "${model[@]}" --steps "$steps" --stage 2 --quiet --trace "$work/batches"

# zero2 NAME STAGE: a run's --json, and each rank's peak resident set (/usr/bin/time's %M: the kernel's
# ru_maxrss of the rank, KiB) in NAME.rss.<rank>.
zero2() {
  timeout 600 mpirun -n 2 sh -c 'exec /usr/bin/time -f %M -o "$0.$PMI_RANK" "$@"' "$work/$1.rss" \
    "$build/train_bert_mini" "${model[@]}" --steps "$steps" --stage "$2" --quiet --json "$work/$1.json"
}
# deepspeed NAME STAGE [--comms]: tests/peers/deepspeed_bench.py's JSON.
deepspeed() {
  local name=$1 stage=$2
  shift 2
  timeout 600 "$python" tests/peers/deepspeed_bench.py "$work/batches" --stage "$stage" --dropout 0.1 \
    --json "$work/$name.json" "$@" >"$work/$name.log" 2>&1 || { tail -n 20 "$work/$name.log"; exit 1; }
}
configurations=(zero2_s2 deepspeed_s2 zero2_s0 deepspeed_s0)
for round in $(seq 1 "$rounds"); do
  for k in 0 1 2 3; do
    name=${configurations[$(((k + round - 1) % 4))]}
    cut -d' ' -f1 /proc/loadavg >"$work/${name}_$round.load"  # what else ran: the 1-minute load as it starts
    case $name in
      zero2_*) zero2 "${name}_$round" "${name#zero2_s}" ;;
      deepspeed_*) deepspeed "${name}_$round" "${name#deepspeed_s}" ;;
    esac
  done
done
# The comms logger synchronizes after every collective: its runs are not among the timed ones.
deepspeed deepspeed_s2_comms 2 --comms
deepspeed deepspeed_s0_comms 0 --comms

# The kernel OpenBLAS chose for this CPU (it prints it when loaded with OPENBLAS_VERBOSE=2): a CPU its
# DYNAMIC_ARCH does not recognise gets a generic one (Prescott: SSE3), which costs zero2 most of its speed.
OPENBLAS_VERBOSE=2 "$build/train_bert_mini" --help 2>&1 | sed -n 's/^Core: //p' | head -n 1 >"$work/openblas_core"
/usr/bin/python3 - "$work" "$rounds" "$steps" "$build" <<'PY'
import json, os, statistics, sys
work, rounds, steps, build = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def load(name): return json.load(open(os.path.join(work, name + ".json")))
def step_ms(name):
    d = load(name)
    return [s["ms"] for s in d["steps"]] if name.startswith("zero2") else d["step_ms"]
def tokens(name): return 2048 / (statistics.median(step_ms(name)[1:]) / 1e3)
MiB = lambda b: f"{b / 2**20:,.1f} MiB"
ds = load("deepspeed_s2_1")
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"zero2 ({build}/train_bert_mini) and DeepSpeed {ds['deepspeed']} (torch {ds['torch']}, transformers "
      f"{ds['transformers']}, BertForMaskedLM) on {cpu}, {os.cpu_count()} cores:")
print(f"BERT-mini L 4, H 256, 4 heads, F 1024, T 128, micro-batch 8 per rank, N = 2, fp32, dropout 0.1, one thread "
      f"per rank, the same batches and rates; {steps} steps a run, {rounds} rounds rotating the order")
print(f"tokens/s of a run = N B T / median step time of steps 2..{steps} = 2048 / median")
print(f"zero2's sgemm: OpenBLAS's {open(os.path.join(work, 'openblas_core')).read().strip() or '?'} kernel (the one it "
      f"chose for this CPU); DeepSpeed's: PyPI torch's MKL and oneDNN")
print()
print(f"  {'configuration':<24}{'min':>9}{'median':>9}{'max':>9}   tokens/s over {rounds} runs")
label = {"zero2_s2": "zero2 --stage 2", "deepspeed_s2": "DeepSpeed ZeRO-2", "zero2_s0": "zero2 --stage 0",
         "deepspeed_s0": "DeepSpeed stage 0"}
table = {}
for config in ("zero2_s2", "deepspeed_s2", "zero2_s0", "deepspeed_s0"):
    table[config] = [tokens(f"{config}_{r}") for r in range(1, rounds + 1)]
    t = table[config]
    print(f"  {label[config]:<24}{min(t):>9,.0f}{statistics.median(t):>9,.0f}{max(t):>9,.0f}")
loads = [float(open(os.path.join(work, f"{c}_{r}.load")).read()) for c in table for r in range(1, rounds + 1)]
print(f"  the machine's 1-minute load average as each run started: {min(loads):.2f} .. {max(loads):.2f} "
      f"(about 2 when only these runs use the machine: their own 2 ranks)")
for stage in (2, 0):
    ratios = [z / d for z, d in zip(table[f"zero2_s{stage}"], table[f"deepspeed_s{stage}"])]
    print(f"  zero2 / DeepSpeed, stage {stage}: zero2's tokens/s / DeepSpeed's in the same round: "
          + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {statistics.median(ratios):.3f}")
for who in ("zero2", "deepspeed"):
    ratios = [a / b for a, b in zip(table[f"{who}_s2"], table[f"{who}_s0"])]
    print(f"  {'zero2' if who == 'zero2' else 'DeepSpeed'} stage 2 / stage 0 (same round): "
          + ", ".join(f"{r:.3f}" for r in ratios))

print()
print("Peak resident memory per rank (the kernel's high-water mark: zero2's is /usr/bin/time's %M, ru_maxrss of the")
print("rank; DeepSpeed's is VmHWM of /proc/self/status, since a torchrun child's ru_maxrss starts at torchrun's own),")
print("the median over the rounds:")
for config in ("zero2_s2", "deepspeed_s2", "zero2_s0", "deepspeed_s0"):
    names = [f"{config}_{r}" for r in range(1, rounds + 1)]
    if config.startswith("zero2"):
        ranks = [[int(open(os.path.join(work, f"{n}.rss.{k}")).read().split()[-1]) for n in names] for k in (0, 1)]
        print(f"  {label[config]:<24}" + ", ".join(f"rank {k} {MiB(statistics.median(v) * 1024)}" for k, v in enumerate(ranks)))
    else:
        ranks = [[load(n)["rss_kib"][k]["end"][1] for n in names] for k in (0, 1)]
        imported = [[load(n)["rss_kib"][k]["imported"][0] - load(n)["rss_kib"][k]["python"][0] for n in names] for k in (0, 1)]
        print(f"  {label[config]:<24}" + ", ".join(
            f"rank {k} {MiB(statistics.median(v) * 1024)}, of which imports {MiB(statistics.median(i) * 1024)} "
            f"({statistics.median(i) / statistics.median(v):.0%})" for k, (v, i) in enumerate(zip(ranks, imported))))
print("  (imports = VmRSS after `import torch, deepspeed, transformers` minus VmRSS at Python's start)")

print()
print("Bytes sent per rank per step, as a ring sends them (an all-reduce of S bytes: 2 (N-1)/N S; an all-gather")
print("of P bytes from each rank: (N-1) P; a reduce-scatter of S bytes: (N-1)/N S), N = 2:")
for stage in (2, 0):
    d = load(f"deepspeed_s{stage}_comms")
    z = load(f"zero2_s{stage}_1")["comm"]
    total = 0
    parts = []
    for op, c in sorted(d["comm"].items()):
        message = c["message_bytes_per_step"]
        sent = message * (2 * (2 - 1) / 2 if op.startswith("all_reduce") else (2 - 1) if op.startswith("all_gather") else 1)
        total += sent
        parts.append(f"{op} {c['calls_per_step']:g} calls, {message:,.0f} bytes given -> {sent:,.0f} sent")
    print(f"  DeepSpeed stage {stage} (its comms logger, steps 2..{steps}): " + "; ".join(parts) + f"; total {total:,.0f}")
    ztotal = z["reduce_scatter_bytes_per_step"] + z["all_gather_bytes_per_step"] + z["all_reduce_bytes_per_step"]
    print(f"  zero2 --stage {stage} (--json comm): reduce-scatter {z['reduce_scatter_bytes_per_step']:,}, all-gather "
          f"{z['all_gather_bytes_per_step']:,}, all-reduce {z['all_reduce_bytes_per_step']:,}; total {ztotal:,} "
          f"(formula {z['formula_bytes_per_step']:,}; besides: {z['other_bytes_per_step']:,} of loss and norm sums)")
    print(f"  DeepSpeed / zero2, stage {stage}: {total:,.0f} / {ztotal:,} = {total / ztotal:.3f}")

print()
z = load("zero2_s2_1")
e = ds["estimator"]
psi, n = e["psi"], 2
m = z["memory"]
print(f"Model states per rank, stage 2, N = 2 (Psi = {psi:,} parameters; zero2's Psi = {z['params']:,}):")
print(f"  DeepSpeed's estimator (stage_1_and_2.estimate_zero2_model_states_mem_needs, no offload): 2 Psi + 18 Psi / N "
      f"= {e['per_gpu_bytes']:,} bytes per GPU ({MiB(e['per_gpu_bytes'])}): 16-bit parameters (2 Psi) and "
      f"gradients, an fp32 master, m and v (18 Psi / N); its CPU column 4 Psi N x 1.5 = {e['per_cpu_bytes']:,}")
counted = ds["model_states"]
print(f"  DeepSpeed's tensors, counted on rank 0 after the last backward (fp32 here): "
      + ", ".join(f"{k} {v:,}" for k, v in counted.items()) + f"; total {sum(counted.values()):,} ({MiB(sum(counted.values()))})")
print(f"    = 4 Psi + 4 Psi/N (fp32 partition) + ~4 Psi/N (the gradient partition, whole parameters) + 8 Psi/N "
      f"= {4 * psi + 16 * psi // n:,} by the formula 4 Psi + 16 Psi/N; the reduce buckets (2 x reduce_bucket_size x 4 "
      f"with overlap_comm) live during backward only")
print(f"  zero2 --stage 2 (--json memory, the run's allocation = train_bert_mini --plan's row): params "
      f"{m['params_bytes']:,} + grads {m['grads_bytes']:,} + m, v {m['optimizer_bytes']:,} + master {m['master_bytes']:,} "
      f"= {m['model_states_bytes']:,} ({MiB(m['model_states_bytes'])}), formula {m['model_states_formula']} = "
      f"{m['model_states_formula_bytes']:,}")
print(f"  DeepSpeed counted / zero2: {sum(counted.values()):,} / {m['model_states_bytes']:,} = "
      f"{sum(counted.values()) / m['model_states_bytes']:.3f}; DeepSpeed's estimate / zero2: "
      f"{e['per_gpu_bytes'] / m['model_states_bytes']:.3f}")
PY
