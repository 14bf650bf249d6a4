#!/usr/bin/env bash
# tests/gpu_check.sh — the GPU check, for a machine with one NVIDIA GPU, in two passes sized for a lease
# of 15 minutes of device time from a bare machine (the tree copied over, nothing installed, no network):
#
#   tests/gpu_check.sh prepare   on a Debian machine with apt (this repo's dev machine): downloads the .deb
#                                files the GPU machine lacks into .gpu-debs/ (git-ignored, ~30 MB), to
#                                carry with the tree
#   tests/gpu_check.sh quick     FIRST, on the GPU machine: at most 4 minutes from a bare machine
#   tests/gpu_check.sh full [N...]  then, in the same lease: sections 3-14 below, at most 8 minutes
#                                (N...: only these sections, e.g. `full 8 11`, to rerun what failed)
#   tests/gpu_check.sh           this usage
#
# Every step prints what it measured (with numbers) and what it could not run, and its seconds against its
# limit; each mode ends with a summary, the seconds per step (to re-budget the next lease), and
# "gpu check: OK" or "gpu check: FAILED" (exit 0 or 1). A step's verdict lines are OK, FAILED or NOT RUN;
# NOT RUN fails nothing (a flag that has not landed, a dry run's GPU-only claim), FAILED fails the check.
# Each step runs in a session of its own under a time limit (setsid; at the limit every process of that
# session and every descendant is killed: Hydra's proxy and ranks make sessions of their own), and no step
# runs past the mode's budget (quick 240 s, full 480 s; Z2_GPU_CHECK_BUDGET=SECONDS changes it): a hang
# costs its step's limit, never the lease. The limits and the seconds per step are the GPU machine's
# (16 cores); Z2_GPU_CHECK_SCALE=K multiplies every limit and the budget (a dry run: 4).
#
# quick (the claims a lease must not end without; measured budget in notes/gpu/README.md):
#   1. the device: nvidia-smi's name, compute capability, memory and driver; the build's architecture
#      from the compute capability (-gencode arch=compute_XY,code=sm_XY; PTX for the newest
#      architecture nvcc knows if it does not know this one; nvcc -arch=native if nvidia-smi cannot say);
#   2. dependencies: the system's MPICH, doctest and OpenBLAS if present, else the carried .debs
#      unpacked under /tmp/z2deps (not into /: dpkg -x runs no scripts and would overwrite the image's
#      files), with an mpicxx wrapper;
#   3. the nvcc build of what quick runs, for that architecture only: build/train_bert_mini and
#      build/test_zero2 (make -j$(nproc)); kept for `full` (a stamp names its architecture and MPI);
#   4. the doctest stage matrices on the CUDA backend (-tc: stages x overlap x buckets, with A = 3,
#      (N, A) invariance, bf16 / fp16, ZeRO-R's modes, ZeRO-Offload's) at N = 1, where NCCL is one of
#      the backends, and N = 2 over MPI sharing the GPU (NCCL refuses two ranks on one GPU);
#   5. `make run` on the GPU: mpirun -n 2 build/train_bert_mini --device cuda --stage 2 (100 steps,
#      MPI: one GPU), ms per step, tokens/s, the loss falling;
#   6. ZeRO-Offload on the GPU (--offload-optimizer cpu): the hash of the run without it, at N = 1
#      (NCCL) stage 2 bf16 and N = 2 (MPI) stage 1 fp32; the step times beside each other;
#   7. the simulated device against the GPU: --device sim and --device cuda give one final hash and
#      last loss (two rows of tests/golden_bits.txt, which must match too), in portable mode (why:
#      at the step);
#   8. the timeline (--timeline FILE): the GPU run's file parses and has events on two streams or
#      more; NOT RUN while the trainer has no --timeline.
#
# full (the sections keep the numbers the notes cite; 0-2 are quick's 1-3, and continue quick's build;
# what quick measured is not run again, and one run stands for every section that asks for the same
# configuration; section 3 runs last):
#   3. (run last: the longest, and the budget should cut it before a GPU-only section) the doctest
#      suite under mpirun -n 1, 2, 4 without quick's stage matrices (the CUDA backends: cuda/nccl at
#      N = 1, cuda/mpi at every N), with what tests/test_conversions_gpu.cu measured quoted (the 16-bit
#      conversions against __float2bfloat16_rn / __float2half_rn over all 2^32 floats, zero2's exp /
#      log / erf in a kernel against the CPU's bits, the portable gemm kernel against the CPU
#      schedule); then the quick checks of tests/cli's files that run the trainer on the device
#      (stages, ledgers, zero_r, precision, portable, traces, offload; the rest check inputs, formats
#      and tools, which CI checks on the CPU; PyTorch is skipped: the image has no python3-torch);
#   4. the stage demo on the GPU at N = 1 (NCCL) and N = 2 (MPI), overlap on and off: bitwise equal
#      stages and median step times (N = 4 is left to the suite);
#   5. BERT-mini on the GPU at N = 1 (NCCL), stage 2, 30 steps: tokens/s and ms per step (N = 2 is
#      quick's `make run`); this run is also section 6's keep, 7's fp32, 11's cuBLAS and 14's plain fp32;
#   6. ZeRO-R on the GPU: --activations keep, recompute and offload: median step times and their
#      ratios (offload close to recompute: the copy stream hid the copies), one final hash in all
#      three and in offload with the naive allocator, and the arena's promise: one cudaMalloc (the
#      block; cuBLAS's and NCCL's own are not counted) and no allocation after step 1;
#   7. mixed precision on the GPU (cuBLAS GemmEx, 16-bit NCCL): fp32, bf16 and fp16 at stage 2, the
#      step-time ratios; bf16 at stage 0 gives stage 2's hash (the 16-bit conversions: section 3);
#   8. checkpoints on the GPU, bf16 and fp16: 20 steps at N = 1 (NCCL) stage 2, A = 2, straight; the
#      same saved every 10 steps at N = 2 (MPI) stage 2; step_10 loaded at N = 1 (NCCL) stage 1 and
#      continued: one final hash; the save and load times;
#   9. a public DeepSpeed config on the GPU (tests/ds_configs/hand_written.json): it runs, and its
#      forward / backward / step milliseconds;
#  10. capacity on the GPU: --plan against the measured ledger to the byte, fp32 and bf16; --alloc
#      caching and cuda give the arena's hash, with their peak reserved; demos/superlinear.sh with
#      --device cuda at 1 GiB per rank (was 4 GiB: the same table, smaller micro-batches, a quarter
#      of the time);
#  11. portable bits on the GPU: every row of tests/golden_bits.txt at N = 2 over MPI and the N = 1
#      rows over NCCL must give the CPU's hashes (the kernel against the CPU schedule: section 3);
#      the portable step time beside cuBLAS's;
#  12. reliability on the GPU: a model far larger than the GPU refused against cudaMemGetInfo within
#      seconds; ZERO2_MEMORY_LIMIT one MiB under the plan's block refused, twice it trains; an output
#      naming a device node refused, the node kept;
#  13. traces on the GPU (notes/12): the GPU run's trace against the CPU run's (tests/check_trace.py),
#      the GPU started from the CPU's weights (--init-hf) bit for bit, (N, A) = (1, 2) and (2, 1) the
#      same files;
#  14. ZeRO-Offload's step times on the GPU: N = 1 (NCCL) stage 2 fp32 and bf16, N = 2 (MPI) stage 1
#      bf16, 30 steps with and without offload: one hash, the ratio, the ledger's device and host model
#      states against their formulas; --host-threads 1 against the default (the machine's cores at
#      N = 1): one hash, the offloaded optimizer step's time each way.
#
# Z2_GPU_CHECK_DRY=1: a dry run on a machine without a GPU, to check this script's plumbing (its steps,
# limits, JSON reading and summary) where it is edited: no nvidia-smi and no nvcc build (the g++ build,
# build-cpu/, made incrementally instead; the nvcc command line is printed); every --device cuda becomes
# --device sim (the cuda backend's streams, events and copies, run on the CPU) and --comm nccl becomes
# --comm mpi; in quick's step 7 cpu stands in for cuda (sim against sim would prove nothing); a claim
# only a GPU can make (the GPU's free memory, --alloc cuda, NCCL, test_conversions_gpu.cu's MESSAGEs) is
# NOT RUN; the limits are 4 times longer (2 cores). Its verdict says nothing about the GPU.
# `Z2_GPU_CHECK_DRY=1 tests/gpu_check.sh quick` passes on the dev machine (2 cores, idle: 25 s), and
# so does `full` (5 minutes; the superlinear table NOT RUN).
set -u
cd "$(dirname "$0")/.." || exit 2
self="$PWD/tests/gpu_check.sh"
debs_dir=.gpu-debs
packages="mpich libmpich12 libmpich-dev libhwloc15 libucx0 libnuma1 libibverbs1 librdmacm1 libnl-3-200
          libnl-route-3-200 libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev doctest-dev
          libgfortran5 libquadmath0 nlohmann-json3-dev libslurm38 libudev1 libssl-dev libssl3 python3-numpy
          libblas3 liblapack3"
mode=${1:-}

usage() {
  cat <<'EOF'
usage: tests/gpu_check.sh quick | full [SECTION...] | prepare

  quick     run this FIRST when a GPU is lent (at most 4 minutes from a bare machine): the device and
            its architecture, the nvcc build, the doctest stage matrices on CUDA (N = 1 NCCL, N = 2
            MPI), make run on the GPU, ZeRO-Offload's hash, --device sim against the GPU in portable
            mode, the timeline
  full      then, in the same lease if time is left (at most 8 minutes): everything else, sections
            3-14 (the suite, demo, BERT-mini timed, ZeRO-R, mixed precision, checkpoints, a DeepSpeed
            config, capacity, portable, reliability, traces, ZeRO-Offload's step times); `full 8 11`
            runs only those sections
  prepare   on a Debian machine with apt: download the .debs a GPU machine without MPICH, doctest
            and OpenBLAS needs into .gpu-debs/ (carry it with the tree)

Z2_GPU_CHECK_DRY=1 runs either mode without a GPU (--device sim for cuda, mpi for nccl, the g++ build):
the script's plumbing only. The header of tests/gpu_check.sh says what each step checks.
EOF
}

if [ "$mode" = prepare ]; then
  mkdir -p "$debs_dir"
  grep -qx "/$debs_dir/" .git/info/exclude 2>/dev/null || echo "/$debs_dir/" >>.git/info/exclude
  # shellcheck disable=SC2086  # the package names are words
  (cd "$debs_dir" && apt-get download $packages) || { echo "apt-get download failed"; exit 1; }
  du -sh "$debs_dir"
  exit 0
fi

# --- what every step shares ---------------------------------------------------------------------------
dry=${Z2_GPU_CHECK_DRY:-}
if [ -n "$dry" ]; then
  build=build-cpu dev=sim nccl=mpi scale=${Z2_GPU_CHECK_SCALE:-4}
else
  build=build dev=cuda nccl=nccl scale=${Z2_GPU_CHECK_SCALE:-1}
fi
trainer=$build/train_bert_mini
work=/tmp/z2_gpu_check     # every step's files; the runs one section shares with another (runs/)
export OPENBLAS_NUM_THREADS=1
export Z2_NO_TORCH=1       # no python3-torch on the GPU image: tests/cli skips those checks, saying so

# A step's verdicts: one line each, to the step's file (the summary reads it) and to the log.
ok() { printf 'OK|%s\n' "$*" >>"$Z2_STEP_FILE"; echo "=== $*"; }
bad() { printf 'FAILED|%s\n' "$*" >>"$Z2_STEP_FILE"; echo "=== FAILED: $*"; }
not_run() { printf 'NOT RUN|%s\n' "$*" >>"$Z2_STEP_FILE"; echo "=== NOT RUN: $*"; }
# json FILE EXPR: a Python expression over the JSON file, read as d.
json() { python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }
# py EXPR: a Python expression (arithmetic on numbers the step has).
py() { python3 -c "print($1)"; }
# run_json KEY COMMAND...: COMMAND --json $work/runs/KEY.json, its output in KEY.log, under a limit of
# ${run_limit:-120} s; a run another section made already (the same KEY) is reused, not run again.
run_json() {
  local key=$1 file=$work/runs/$1.json
  shift
  if [ -s "$file" ]; then echo "(reusing run $key)"; return 0; fi
  if timeout "$(scaled "${run_limit:-120}")" "$@" --json "$file" </dev/null >"$work/runs/$key.log" 2>&1 && [ -s "$file" ]; then return 0; fi
  echo "--- $key failed: $*"
  tail -n 8 "$work/runs/$key.log"
  rm -f "$file"
  return 1
}
on_gpu() { [ -z "$dry" ]; }
scaled() { echo $(($1 * scale)); }  # a time limit, longer in a dry run (2 cores, the simulated device)
dry_note() { [ -n "$dry" ] && echo " [dry: --device $dev]"; }

# run_step NAME LIMIT FUNCTION: FUNCTION in a session of its own (this script again, as `__step
# FUNCTION`), killed with all it started (TERM, then KILL 3 s later) at LIMIT seconds or at the mode's budget, whichever comes first;
# its verdict lines and seconds go to the summary. A step with under 10 s of budget left is not started.
step_names=()
run_step() {
  local name=$1 limit=$2 fn=$3 start left pid sid="" pids timed_out="" rc
  step_number=$((${step_number:-0} + 1))
  export Z2_STEP_FILE=$work/step_$step_number
  : >"$Z2_STEP_FILE"
  step_names+=("$name")
  left=$((budget - $(date +%s) + started))
  if [ "$left" -lt 10 ]; then
    printf 'NOT RUN|out of the %s mode'"'"'s budget of %d s\n' "$mode" "$budget" >>"$Z2_STEP_FILE"
    echo "0 0" >"$Z2_STEP_FILE.time"
    return
  fi
  limit=$((limit * scale))
  [ "$limit" -gt "$left" ] && limit=$left
  echo
  echo "##### $name (limit $limit s)"
  start=$(date +%s)
  if command -v setsid >/dev/null; then
    setsid --wait bash "$self" __step "$fn" </dev/null &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
      if [ $(($(date +%s) - start)) -ge "$limit" ]; then
        timed_out=yes
        sid=$(cat "$Z2_STEP_FILE.sid" 2>/dev/null)
        if [ -n "$sid" ]; then
          pids=$(step_processes "$sid")
          # shellcheck disable=SC2086  # the pids are words
          kill -TERM $pids 2>/dev/null
          sleep 3
          # shellcheck disable=SC2086,SC2046
          kill -KILL $pids $(step_processes "$sid") 2>/dev/null
        fi
        kill -KILL "$pid" 2>/dev/null
        break
      fi
      sleep 1
    done
    wait "$pid"
    rc=$?
  else  # no setsid: only the limits of the commands inside the step hold
    echo "(no setsid on this machine: the step's own command limits only)"
    timeout --kill-after=5 "$limit" bash "$self" __step "$fn" </dev/null
    rc=$?
    [ "$rc" -eq 124 ] && timed_out=yes
  fi
  if [ -n "$timed_out" ]; then
    printf 'FAILED|timed out after %d s (every process of the step killed); the verdicts above it stand\n' \
      "$limit" >>"$Z2_STEP_FILE"
  elif [ "$rc" -ne 0 ] && ! grep -q '^FAILED|' "$Z2_STEP_FILE"; then
    printf 'FAILED|the step exited %d\n' "$rc" >>"$Z2_STEP_FILE"
  fi
  [ -s "$Z2_STEP_FILE" ] || printf 'FAILED|the step reported nothing\n' >>"$Z2_STEP_FILE"
  echo "$(($(date +%s) - start)) $limit" >"$Z2_STEP_FILE.time"
  echo "##### $name: $(($(date +%s) - start)) s"
}
step_processes() {  # SID: the step's processes: its session's, and every descendant of one (Hydra's
                    # proxy and each rank it starts make sessions of their own)
  ps -eo pid=,ppid=,sid= | awk -v sid="$1" '
    { pid[NR] = $1; ppid[NR] = $2; if ($3 == sid) mine[$1] = 1 }
    END {
      do {
        added = 0
        for (i = 1; i <= NR; i++) if (!(pid[i] in mine) && (ppid[i] in mine)) { mine[pid[i]] = 1; added = 1 }
      } while (added)
      for (p in mine) print p
    }'
}
# A step run in-process (it changes this shell: PATH, the build's architecture), with no limit of its own.
run_here() {  # NAME FUNCTION
  local name=$1 fn=$2 start
  step_number=$((${step_number:-0} + 1))
  export Z2_STEP_FILE=$work/step_$step_number
  : >"$Z2_STEP_FILE"
  step_names+=("$name")
  echo
  echo "##### $name"
  start=$(date +%s)
  "$fn"
  [ -s "$Z2_STEP_FILE" ] || printf 'FAILED|the step reported nothing\n' >>"$Z2_STEP_FILE"
  echo "$(($(date +%s) - start)) -" >"$Z2_STEP_FILE.time"
}
summary() {
  local i=0 name seconds limit failed=0 not_run_count=0 ok_count=0 verdict line
  echo
  echo "=== summary ($mode$([ -n "$dry" ] && echo ', DRY RUN: no GPU, --device sim'), $(($(date +%s) - started)) s of a $budget s budget)"
  for name in "${step_names[@]}"; do
    i=$((i + 1))
    read -r seconds limit <"$work/step_$i.time"
    verdict=OK
    grep -q '^NOT RUN|' "$work/step_$i" && verdict="NOT RUN (in part)"
    grep -q '^FAILED|' "$work/step_$i" && verdict=FAILED
    printf '%s: %s, %s s%s\n' "$name" "$verdict" "$seconds" "$([ "$limit" != - ] && echo " (limit $limit)")"
    while IFS= read -r line; do
      case "$line" in
        OK\|*) ok_count=$((ok_count + 1)); echo "  ${line#OK|}" ;;
        FAILED\|*) failed=$((failed + 1)); echo "  FAILED: ${line#FAILED|}" ;;
        NOT\ RUN\|*) not_run_count=$((not_run_count + 1)); echo "  NOT RUN: ${line#NOT RUN|}" ;;
      esac
    done <"$work/step_$i"
  done
  echo "seconds per step: $(i=0; for name in "${step_names[@]}"; do i=$((i + 1)); printf '%s: %s s; ' "${name%%.*}" "$(cut -d' ' -f1 "$work/step_$i.time")"; done)"
  echo "$ok_count OK, $failed FAILED, $not_run_count NOT RUN"
  if [ "$failed" -eq 0 ]; then echo "gpu check: OK"; else echo "gpu check: FAILED"; fi
  [ "$failed" -eq 0 ]
}

# --- steps both modes begin with ----------------------------------------------------------------------------
# The architecture of the GPU at hand, for nvcc: only its code keeps the build short.
step_device() {
  if [ -n "$dry" ]; then
    not_run "the device: a dry run (Z2_GPU_CHECK_DRY=1) reads no nvidia-smi; the build would be for sm_90"
    cuda_arch="-gencode arch=compute_90,code=sm_90"
    return
  fi
  local query cap name memory driver nvcc_bin arches newest
  query=$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  IFS=, read -r name cap memory driver <<<"$query"
  cap=$(echo "${cap:-}" | tr -d ' .')
  nvcc_bin=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  if [[ "$cap" =~ ^[0-9]+$ ]]; then
    arches=$("$nvcc_bin" --list-gpu-arch 2>/dev/null | tr '\n' ' ')
    if [ -z "$arches" ] || [[ " $arches " == *" compute_$cap "* ]]; then
      cuda_arch="-gencode arch=compute_$cap,code=sm_$cap"
    else  # newer than this nvcc: PTX for the newest it knows, compiled by the driver at load
      newest=$(echo "$arches" | tr ' ' '\n' | grep -E '^compute_[0-9]+$' | sort -t_ -k2 -n | tail -n 1)
      cuda_arch="-gencode arch=$newest,code=$newest"
    fi
    ok "the device: $(echo "$name" | xargs), compute capability ${cap:0:-1}.${cap: -1},$memory, driver$driver; nvcc $("$nvcc_bin" --version 2>/dev/null | grep -oE 'release [0-9.]+' | cut -d' ' -f2); CUDA_ARCH=\"$cuda_arch\""
  else  # nvcc 11.6 and later ask the driver (an older nvcc fails the build, saying so)
    cuda_arch="-arch=native"
    not_run "the device: nvidia-smi gave no compute capability ('$query'); the build uses nvcc -arch=native"
  fi
}

step_dependencies() {
  # Z2_CARRIED_DEBS=1 uses the .debs even where the system has the packages (how this path is tested on
  # the dev machine). The system's MPI counts only if it is MPICH: an image may ship Open MPI, whose
  # mpirun refuses to run as root and which this project is not tested on.
  if [ -z "${Z2_CARRIED_DEBS:-}" ] && command -v mpicxx >/dev/null && command -v mpichversion >/dev/null &&
     [ -f /usr/include/doctest/doctest.h ] &&
     [ -f /usr/include/nlohmann/json.hpp ] && [ -f /usr/include/openssl/evp.h ] &&
     { [ -f /usr/include/x86_64-linux-gnu/cblas.h ] || [ -f /usr/include/cblas.h ]; }; then
    ok "dependencies: from the system"
  elif [ -d "$debs_dir" ]; then
    local prefix=/tmp/z2deps deb lib
    lib=$prefix/usr/lib/x86_64-linux-gnu
    if [ ! -f "$prefix/.unpacked" ]; then  # quick unpacked them already when full follows it
      mkdir -p "$prefix/bin"
      for deb in "$debs_dir"/*.deb; do dpkg -x "$deb" "$prefix"; done
      # nvcc -ccbin wants one executable: a wrapper that adds the include and library directories
      # (link flags are ignored when only compiling).
      cat >"$prefix/bin/mpicxx" <<EOF
#!/bin/sh
exec g++ -I$prefix/usr/include/x86_64-linux-gnu/mpich -I$prefix/usr/include \\
  -I$prefix/usr/include/x86_64-linux-gnu/openblas-pthread "\$@" \\
  -L$lib -L$lib/openblas-pthread -L$prefix/lib/x86_64-linux-gnu -lmpichcxx -lmpich
EOF
      # Hydra finds hydra_pmi_proxy next to the mpiexec it was started as.
      printf '#!/bin/sh\nexec %s "$@"\n' "$prefix/usr/bin/mpiexec.hydra" >"$prefix/bin/mpirun"
      chmod +x "$prefix/bin/mpicxx" "$prefix/bin/mpirun"
      touch "$prefix/.unpacked"
    fi
    export PATH="$prefix/bin:$PATH"
    export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread:$prefix/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
    ok "dependencies: carried .debs ($(find "$debs_dir" -name '*.deb' | wc -l)) unpacked under $prefix"
  else
    bad "dependencies: MISSING (no system MPICH/doctest/OpenBLAS and no $debs_dir: run 'tests/gpu_check.sh prepare' on a machine with apt and carry $debs_dir)"
    return 1
  fi
  # tests/check_trace.py and the trace tests read traces with numpy: the carried python3-numpy where the
  # image's python has none (the same Python minor version as Debian 12's, 3.11, is assumed).
  python3 -c 'import numpy' 2>/dev/null || [ ! -d /tmp/z2deps/usr/lib/python3/dist-packages ] ||
    export PYTHONPATH=/tmp/z2deps/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}
}

# The nvcc build of TARGETS for the architecture at hand. A build/ this script made (its stamp names the
# architecture and the MPI) is continued; any other (carried, or from another MPI) is built from scratch.
build_targets() {  # TARGETS...
  local stamp want targets=() target arch_arg=()
  if [ -n "$dry" ]; then
    for target in "$@"; do
      case "$target" in all) targets+=(cpu) ;; *) targets+=("build-cpu/${target#build/}") ;; esac
    done
    echo "(dry: the nvcc build would be: make -j$(nproc) CUDA_ARCH=\"$cuda_arch\" $*)"
    if make -j"$(nproc)" "${targets[@]}" >"$work/build.log" 2>&1; then
      not_run "nvcc build: a dry run; the g++ build instead, make ${targets[*]}: up to date or rebuilt"
    else
      tail -n 40 "$work/build.log"
      bad "build: make ${targets[*]} failed (log above)"
    fi
    return
  fi
  stamp=build/.gpu_check_stamp
  want="CUDA_ARCH=$cuda_arch mpicxx=$(command -v mpicxx)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then rm -rf build; fi
  mkdir -p build
  echo "$want" >"$stamp"  # before make: a build cut short by its limit is continued, not redone
  [ -n "$cuda_arch" ] && arch_arg=(CUDA_ARCH="$cuda_arch")
  # (found: what the Makefile found, NCCL above all: without it --comm nccl is refused)
  if make -j"$(nproc)" "${arch_arg[@]}" found "$@" >"$work/build.log" 2>&1; then
    grep -E "^  (nvcc|NCCL|MPI):" "$work/build.log"
    local arches=${cuda_arch:-"the Makefile's architectures"}
    ok "build: nvcc, $* for $arches, make -j$(nproc): $(grep -cE '^(/[^ ]*/)?nvcc |^mpicxx .* -c ' "$work/build.log") objects compiled; NCCL: $(grep -m 1 '^  NCCL:' "$work/build.log" | sed 's/^  NCCL: *//')"
  else
    tail -n 40 "$work/build.log"
    bad "build: make $* failed (log above)"
  fi
}

# --- quick ---------------------------------------------------------------------------------------------------
quick_build() { build_targets build/train_bert_mini build/test_zero2; }

# The stage-matrix test cases of the doctest suite (doctest's -tc patterns, commas separate them; "?"
# stands for the comma in "offload, fp32").
matrices='*stage matrix*,world-size invariance*,offload? fp32: stages*,ZeRO-R: keep/recompute/offload x arena/naive*'
doctest_run() {  # N LABEL FILTER-OPTION: build/test_zero2 under mpirun -n N; a verdict with its numbers
  local ranks=$1 label=$2 filter=$3 log=$work/doctest_$1.log summary backends expect
  timeout "$(scaled 80)" mpirun -n "$ranks" "$build/test_zero2" "$filter" --duration=true >"$log" 2>&1
  local status=$?
  grep -E '^\[test\]|^[0-9.]+ s: ' "$log"
  summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1 | tr -s ' ')
  backends=$(grep -m 1 -oE 'backends: .*' "$log" | cut -d' ' -f2-)
  if on_gpu; then expect=$([ "$ranks" -eq 1 ] && echo "cuda/mpi cuda/nccl" || echo "cuda/mpi"); else expect=sim/mpi; fi
  local missing="" b
  for b in $expect; do [[ " $backends " == *" $b "* ]] || missing+=" $b"; done
  local seconds
  seconds=$(grep -E '^[0-9.]+ s: ' "$log" | awk '{ s += $1 } END { printf "%.1f", s }')
  if [ "$status" -eq 0 ] && [ -z "$missing" ] && [[ "$summary" == *" 0 failed"* ]]; then
    ok "doctest $label at N=$ranks (backends $backends): ${summary#\[doctest\] test cases: }; ${seconds} s in the test cases"
  else
    grep -E 'ERROR|FAILED|rank [0-9]+:' "$log" | head -n 20
    local why
    why=$(grep -m 1 -oE 'CUDA tests skipped: .*' "$log")
    bad "doctest $label at N=$ranks: exit $status, ${summary:-no summary}${missing:+; backends missing:$missing}${backends:+ (had $backends)}${why:+; $why}"
  fi
}
quick_doctest() {
  doctest_run 1 "stage matrices" -tc="$matrices"
  doctest_run 2 "stage matrices" -tc="$matrices"
}

# make run's command, on the GPU (one GPU: --comm auto takes MPI for two ranks), with --json. (The dry
# run trains 10 steps of the 100: on 2 cores the simulated device takes a minute for 100.)
quick_make_run() {
  local dry_steps=()
  [ -n "$dry" ] && dry_steps=(--steps 10)
  if run_json make_run mpirun -n 2 "$trainer" --device "$dev" --stage 2 "${dry_steps[@]}"; then
    grep -E '^  world' "$work/runs/make_run.log"
    grep -E '^step ' "$work/runs/make_run.log" | sed -n '1p;$p'
    local f=$work/runs/make_run.json verdict
    verdict=$(json "$f" "'%s, %d steps, %.2f ms/step median, %.0f tokens/s, loss %.3f -> %.3f, final hash %s%s' % (d['device'], len(d['steps']), d['time']['step_ms_median'], d['time']['tokens_per_s_median'], d['steps'][0]['loss'], d['steps'][-1]['loss'], d['final_params_hash'], '' if d['steps'][-1]['loss'] < d['steps'][0]['loss'] and d['device'] == '$dev' else ' BAD')")
    case "$verdict" in
      *BAD) bad "make run on the GPU (mpirun -n 2 $trainer --stage 2): the loss did not fall or not on $dev: $verdict" ;;
      *) ok "make run on the GPU (mpirun -n 2, stage 2, comm $(grep -m 1 -oE 'comm [a-z]+' "$work/runs/make_run.log" | cut -d' ' -f2))$(dry_note): $verdict" ;;
    esac
  else
    bad "make run on the GPU (mpirun -n 2 $trainer --device $dev --stage 2): the run failed (log above)"
  fi
}

# ZeRO-Offload: the optimizer's step on the host gives the bits of the step on the device.
offload_pair() {  # KEY RANKS COMM STAGE PRECISION STEPS
  local key=$1 ranks=$2 comm=$3 stage=$4 precision=$5 steps=$6 launch=() flags plain off
  [ "$ranks" -gt 1 ] && launch=(mpirun -n "$ranks")
  flags=("$trainer" --device "$dev" --comm "$comm" --stage "$stage" --precision "$precision" --steps "$steps" --quiet)
  local label
  label="ZeRO-Offload N=$ranks ($comm) stage $stage $precision, $steps steps$(dry_note)"
  if run_json "${key}_plain" "${launch[@]}" "${flags[@]}" && run_json "${key}_off" "${launch[@]}" "${flags[@]}" --offload-optimizer cpu; then
    plain=$work/runs/${key}_plain.json off=$work/runs/${key}_off.json
    local verdict
    verdict=$(python3 - "$plain" "$off" <<'PY'
import json, sys
plain, off = (json.load(open(f)) for f in sys.argv[1:3])
m = off['memory']
same = plain['final_params_hash'] == off['final_params_hash']
ledger = m['model_states_bytes'] == m['model_states_formula_bytes'] and \
    m['host_model_states_bytes'] == m['host_model_states_formula_bytes'] and m['host_model_states_bytes'] > 0
print('%s hash %s %s %s; %.2f ms/step median with offload, %.2f without (offload / none %.2f); device model states '
      '%d bytes, host %d (formulas %d, %d)' % (
          'ok' if same and ledger else 'DIFFERS', off['final_params_hash'], '=' if same else '!=',
          plain['final_params_hash'], off['time']['step_ms_median'], plain['time']['step_ms_median'],
          off['time']['step_ms_median'] / plain['time']['step_ms_median'], m['model_states_bytes'],
          m['host_model_states_bytes'], m['model_states_formula_bytes'], m['host_model_states_formula_bytes']))
PY
)
    case "$verdict" in
      ok*) ok "$label: offload gives the hash without it:${verdict#ok}" ;;
      *) bad "$label: $verdict" ;;
    esac
  else
    bad "$label: a run failed (log above)"
  fi
}
quick_offload() {
  offload_pair q_off1 1 "$nccl" 2 bf16 10
  offload_pair q_off2 2 mpi 1 fp32 10
}

# The simulated device (--device sim: the cuda backend's streams, events and copies, run late and
# poisoned on the CPU) against the GPU, in portable mode. Without --portable the two cannot agree, and
# need not: sim computes its products with OpenBLAS, the GPU with cuBLAS, each summing a product's terms
# in an order of its own (cuBLAS's by kernel, per GPU), so the bits part at the first gemm. --portable
# (notes/11) gives both the same gemm and math in one documented order, so whatever still differs comes
# from the device's own path: a copy on the wrong stream, a missing wait, a kernel that is not the CPU's
# loop. Both must also give tests/golden_bits.txt's row, which the CPU computed.
quick_sim_vs_device() {
  local other=$dev row ranks flags hash bits launch comm
  [ -n "$dry" ] && other=cpu  # sim against sim proves nothing: the dry run compares sim with cpu
  for row in "tiny fp32, N=1" "tiny bf16, N=2"; do
    IFS='|' read -r _ _ ranks flags hash bits < <(grep -F "$row |" tests/golden_bits.txt)
    ranks=${ranks// /} hash=${hash// /} bits=${bits// /}
    launch=(mpirun -n "$ranks")
    comm=mpi
    [ "$ranks" -eq 1 ] && [ "$other" = cuda ] && comm=nccl
    # shellcheck disable=SC2086  # the table's flags are words
    if run_json "sim_$ranks" "${launch[@]}" "$trainer" --device sim --comm mpi $flags --portable --quiet &&
       run_json "${other}_$ranks" "${launch[@]}" "$trainer" --device "$other" --comm "$comm" $flags --portable --quiet; then
      local s o
      s=$(json "$work/runs/sim_$ranks.json" "d['final_params_hash'] + ' ' + d['steps'][-1]['loss_bits']")
      o=$(json "$work/runs/${other}_$ranks.json" "d['final_params_hash'] + ' ' + d['steps'][-1]['loss_bits']")
      if [ "$s" = "$o" ] && [ "$s" = "$hash $bits" ]; then
        ok "--device sim = --device $other ($comm), portable, golden row '$row': hash and last loss bits $s, the table's"
      elif [ "$s" = "$o" ]; then
        bad "--device sim = --device $other ($comm), portable, '$row': both $s, but the table says $hash $bits"
      else
        bad "--device sim != --device $other ($comm), portable, '$row': sim $s, $other $o (the table: $hash $bits)"
      fi
    else
      bad "--device sim against --device $other, portable, '$row': a run failed (log above)"
    fi
  done
}

# The timeline (--timeline FILE, another branch's flag): the file parses and shows work on two streams
# or more. --activations offload: the copy stream carries the checkpoints, so a second stream has events.
quick_timeline() {
  local file=/tmp/z2_timeline.json log=$work/timeline.log status
  rm -f "$file"
  timeout "$(scaled 60)" "$trainer" --device "$dev" --comm "$nccl" --stage 2 --steps 3 --activations offload --quiet \
    --timeline "$file" </dev/null >"$log" 2>&1
  status=$?
  if grep -q "unknown flag '--timeline'" "$log"; then
    not_run "timeline: this trainer has no --timeline (not landed on this branch yet)"
    return
  fi
  if [ "$status" -ne 0 ] || [ ! -s "$file" ]; then
    tail -n 8 "$log"
    bad "timeline: $trainer --device $dev --timeline $file exited $status$([ -s "$file" ] || echo ', no file')"
    return
  fi
  local verdict
  verdict=$(python3 - "$file" <<'PY'
import collections, json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError as error:
    print('UNPARSED %s' % error); sys.exit()
# Chrome's trace-event format (a list, or {"traceEvents": [...]}), or {"events": [...]}: a stream is an
# event's "stream", else its "tid" (metadata events, ph "M", name threads and are not counted).
events = d if isinstance(d, list) else d.get('traceEvents', d.get('events', []))
names = {}
per_stream = collections.Counter()
for e in events:
    if not isinstance(e, dict): continue
    key = e.get('stream', e.get('tid'))
    if e.get('ph') == 'M':
        if e.get('name') == 'thread_name': names[key] = e.get('args', {}).get('name', key)
        continue
    per_stream[key] += 1
streams = ', '.join('%s %d' % (names.get(k, k), n) for k, n in sorted(per_stream.items(), key=lambda kv: str(kv[0])))
print('%s %d events on %d stream(s) (%s)' % ('ok' if len(per_stream) >= 2 else 'TOO FEW STREAMS (2 wanted):',
                                              sum(per_stream.values()), len(per_stream), streams))
PY
)
  case "$verdict" in
    ok*) ok "timeline ($dev, 3 steps, --activations offload)$(dry_note): $file parses,${verdict#ok} ($(wc -c <"$file") bytes)" ;;
    *) bad "timeline ($dev): $file: $verdict" ;;
  esac
}

# --- full: sections 3-14 ----------------------------------------------------------------------------------------
full_build() { build_targets all; }

# 3. the suite: doctest without quick's matrices, then the device's files of tests/cli.
cli_files="stages ledgers zero_r precision portable traces offload"
section_3() {
  local ranks
  for ranks in 1 2 4; do
    doctest_run "$ranks" "suite without the stage matrices" -tce="$matrices"
    cat "$work/doctest_$ranks.log" >>"$work/suite.log"
  done
  # What tests/test_conversions_gpu.cu measured on the GPU, quoted (sections 7 and 11 cite it).
  local message
  for message in "all 2^32 floats on the GPU" "exp / log / erf on the GPU vs the CPU" "the portable gemm kernel on the GPU"; do
    if on_gpu && grep -q "$message" "$work/suite.log"; then
      ok "suite MESSAGE, $message: $(grep -m 1 "$message" "$work/suite.log" | sed 's/.*MESSAGE: //')"
    elif on_gpu; then
      bad "suite MESSAGE '$message': not in the doctest log (the test did not run on the GPU)"
    else
      not_run "suite MESSAGE '$message': a GPU-only test"
    fi
  done
  local log=$work/cli.log line
  ONLY="$cli_files" Z2_QUICK=1 timeout "$(scaled 200)" tests/run_tests.sh "$build" >"$log" 2>&1
  grep -E '^=== [a-z_]+: ' "$log"
  grep -E '^FAIL ' "$log" | head -n 20
  line=$(tail -n 1 "$log")
  if [[ "$line" =~ ^[0-9]+\ passed,\ 0\ failed$ ]]; then
    ok "tests/cli quick checks on the device's path ($cli_files): $line"
  else
    bad "tests/cli quick checks ($cli_files): ${line:-no summary} (FAIL lines above)"
  fi
}

# 4. the stage demo: an MLP of 8.4 M parameters (1024 wide, 8 layers), 64 samples per micro-batch.
section_4() {
  local run ranks comm overlap out
  for run in "1 $nccl 1" "1 $nccl 0" "2 mpi 1" "2 mpi 0"; do
    read -r ranks comm overlap <<<"$run"
    out=$(timeout "$(scaled 60)" mpirun -n "$ranks" "$build/demo_stages" --device "$dev" --comm "$comm" --overlap "$overlap" \
            --hidden 1024 --layers 8 --micro-batch 64 --bucket 1000000 --steps 12 2>&1 </dev/null)
    if echo "$out" | grep -q "identical final parameters"; then
      ok "demo N=$ranks $comm overlap=$overlap$(dry_note): stages bitwise equal; $(echo "$out" | grep '^median step' | sed 's/median step: //')"
    else
      echo "$out" | tail -n 8
      bad "demo N=$ranks $comm overlap=$overlap: $(echo "$out" | grep -v '^$' | tail -n 1 | cut -c1-160)"
    fi
  done
}

# The configuration several sections share: BERT-mini at N = 1, stage 2, 30 steps (5's run, 6's keep,
# 7's fp32, 11's cuBLAS, 14's plain fp32): made once, by whichever section asks first.
base=(--device "$dev" --comm "$nccl" --stage 2 --steps 30 --quiet)
base_run() { run_json n1_fp32 "$trainer" "${base[@]}"; }
median_ms() { json "$work/runs/$1.json" "'%.2f' % d['time']['step_ms_median']"; }
final_hash() { json "$work/runs/$1.json" "d['final_params_hash']"; }

section_5() {
  if base_run; then
    ok "BERT-mini N=1 $nccl stage 2, 30 steps$(dry_note): $(json "$work/runs/n1_fp32.json" "'%s, %.2f ms/step median, %.0f tokens/s, loss %.3f -> %.3f' % (d['device'], d['time']['step_ms_median'], d['time']['tokens_per_s_median'], d['steps'][0]['loss'], d['steps'][-1]['loss'])")"
  else
    bad "BERT-mini N=1 $nccl stage 2: the run failed (log above)"
  fi
}

section_6() {
  local activations key ms=() hashes=() arena
  for activations in keep recompute offload; do
    key=zr_$activations
    [ "$activations" = keep ] && key=n1_fp32
    if [ "$key" = n1_fp32 ]; then base_run; else run_json "$key" "$trainer" "${base[@]}" --activations "$activations"; fi
    if [ -s "$work/runs/$key.json" ]; then
      ms+=("$(median_ms "$key")")
      hashes+=("$(final_hash "$key")")
      arena=$(json "$work/runs/$key.json" "'%d cudaMalloc, %d allocations after step 1, activation peak %.1f MiB' % (d['memory']['device_mallocs'], d['memory']['device_allocations_after_step1'], d['memory']['activation_peak_bytes'] / 1048576)")
      case "$arena" in
        "1 cudaMalloc, 0 allocations"*) ok "ZeRO-R --activations $activations (arena)$(dry_note): ${ms[-1]} ms/step median; $arena" ;;
        *) if on_gpu; then bad "ZeRO-R --activations $activations: allocations after start-up: $arena"
           else not_run "ZeRO-R --activations $activations: the cudaMalloc count on sim ($arena; ${ms[-1]} ms/step)"; fi ;;
      esac
    else
      ms+=(0) hashes+=(none)
      bad "ZeRO-R --activations $activations: the run failed (log above)"
    fi
  done
  # Offload with the naive allocator: the free list and the copy stream together.
  if run_json zr_naive "$trainer" "${base[@]}" --activations offload --alloc naive; then
    hashes+=("$(final_hash zr_naive)")
    ok "ZeRO-R --activations offload --alloc naive$(dry_note): $(json "$work/runs/zr_naive.json" "'%.2f ms/step median, %d allocations per step, fragmentation %.4f' % (d['time']['step_ms_median'], d['memory']['device_allocations_per_step'], d['memory']['fragmentation'])")"
  else
    hashes+=(none)
    bad "ZeRO-R --activations offload --alloc naive: the run failed (log above)"
  fi
  if [ "${hashes[0]}" != none ] && [ "$(printf '%s\n' "${hashes[@]}" | sort -u | wc -l)" -eq 1 ]; then
    ok "ZeRO-R: keep, recompute, offload (arena and naive) give one final hash ${hashes[0]}; $(py "'recompute/keep %.3f, offload/keep %.3f, offload/recompute %.3f (1.0: the copies are hidden)' % (${ms[1]} / ${ms[0]}, ${ms[2]} / ${ms[0]}, ${ms[2]} / ${ms[1]})")"
  else
    bad "ZeRO-R: hashes keep, recompute, offload, naive: ${hashes[*]}"
  fi
}

section_7() {
  local run precision stage key
  for run in "fp32 2" "bf16 2" "fp16 2" "bf16 0"; do
    read -r precision stage <<<"$run"
    key=mixed_${precision}_$stage
    if [ "$run" = "fp32 2" ]; then key=n1_fp32; base_run; else
      run_json "$key" "$trainer" "${base[@]}" --precision "$precision" --stage "$stage"; fi
    if [ -s "$work/runs/$key.json" ]; then
      ok "BERT-mini N=1 $nccl stage $stage --precision $precision$(dry_note): $(json "$work/runs/$key.json" "'%.2f ms/step median, %.0f tokens/s, loss %.3f -> %.3f, model states %d bytes (formula %d), %d skipped' % (d['time']['step_ms_median'], d['time']['tokens_per_s_median'], d['steps'][0]['loss'], d['steps'][-1]['loss'], d['memory']['model_states_bytes'], d['memory']['model_states_formula_bytes'], d['skipped_steps'])")"
    else
      bad "BERT-mini --precision $precision stage $stage: the run failed (log above)"
    fi
  done
  if [ -s "$work/runs/mixed_bf16_2.json" ] && [ -s "$work/runs/mixed_bf16_0.json" ] &&
     [ "$(final_hash mixed_bf16_2)" = "$(final_hash mixed_bf16_0)" ] && [ -s "$work/runs/n1_fp32.json" ] &&
     [ -s "$work/runs/mixed_fp16_2.json" ]; then
    ok "mixed precision: bf16 stages 0 and 2 give one hash $(final_hash mixed_bf16_2); step time fp32/bf16 $(py "'%.2f' % ($(median_ms n1_fp32) / $(median_ms mixed_bf16_2))"), fp32/fp16 $(py "'%.2f' % ($(median_ms n1_fp32) / $(median_ms mixed_fp16_2))")"
  else
    bad "mixed precision: bf16 stage 0 against stage 2: a run failed or the hashes differ"
  fi
}

section_8() {
  local precision ck common verdict
  for precision in bf16 fp16; do
    ck=$work/ck_$precision
    rm -rf "$ck"
    common=(--device "$dev" --precision "$precision" --steps 20 --quiet)
    if run_json "ck_${precision}_straight" "$trainer" "${common[@]}" --comm "$nccl" --stage 2 --accum 2 &&
       run_json "ck_${precision}_saved" mpirun -n 2 "$trainer" "${common[@]}" --comm mpi --stage 2 --save "$ck" --save-every 10 &&
       run_json "ck_${precision}_resumed" "$trainer" --device "$dev" --comm "$nccl" --stage 1 --quiet --load "$ck/step_10"; then
      verdict=$(python3 - "$work/runs/ck_$precision" <<'PY'
import json, sys
straight, saved, resumed = (json.load(open('%s_%s.json' % (sys.argv[1], name))) for name in ('straight', 'saved', 'resumed'))
hashes = {straight['final_params_hash'], saved['final_params_hash'], resumed['final_params_hash']}
first_save, loaded = saved['checkpoint']['saved'][0], resumed['checkpoint']['loaded']
print('%s %s; save %d bytes in %.3f s, load (N=2 stage 2 -> N=1 stage 1, A=%d) in %.3f s' % (
    'ok' if len(hashes) == 1 else 'DIFFERENT', ' '.join(sorted(hashes)), first_save['bytes'], first_save['seconds'],
    resumed['accum'], loaded['seconds']))
PY
)
      case "$verdict" in
        ok*) ok "checkpoint $precision$(dry_note): straight N=1, saved N=2, resumed N=1 stage 1 give one hash ${verdict#ok }" ;;
        *) bad "checkpoint $precision: $verdict" ;;
      esac
    else
      bad "checkpoint $precision: a run failed (log above)"
    fi
  done
}

section_9() {
  if run_limit=60 run_json ds_config "$trainer" --device "$dev" --comm "$nccl" --config tests/ds_configs/hand_written.json \
       --steps 20 --log-every 10; then
    ok "DeepSpeed config hand_written.json$(dry_note): $(json "$work/runs/ds_config.json" "'%s, --activations %s, %.2f ms/step median; last step forward %.2f, backward %.2f, optimizer step %.2f ms' % (d['precision'], d['activations'], d['time']['step_ms_median'], d['steps'][-1]['forward_ms'], d['steps'][-1]['backward_ms'], d['steps'][-1]['optimizer_ms'])")"
  else
    bad "DeepSpeed config hand_written.json: the run failed (log above)"
  fi
}

section_10() {
  local precision cap allocs verdict
  for precision in fp32 bf16; do
    cap=("$trainer" --device "$dev" --comm "$nccl" --precision "$precision" --steps 2 --quiet)
    allocs="arena caching cuda"
    on_gpu || allocs="arena caching"  # --alloc cuda is cudaMalloc per tensor: the GPU's alone
    if run_json "plan_$precision" "${cap[@]}" --plan --plan-world-sizes 1 &&
       run_json "cap_${precision}_arena" "${cap[@]}" &&
       run_json "cap_${precision}_caching" "${cap[@]}" --alloc caching &&
       { ! on_gpu || run_json "cap_${precision}_cuda" "${cap[@]}" --alloc cuda; }; then
      # shellcheck disable=SC2086  # the allocators are words
      verdict=$(python3 - "$work/runs" "$precision" $allocs <<'PY'
import json, sys
runs_dir, precision, allocs = sys.argv[1], sys.argv[2], sys.argv[3:]
plan = [r for r in json.load(open('%s/plan_%s.json' % (runs_dir, precision)))['plan'] if r['stage'] == 2][0]
runs = {a: json.load(open('%s/cap_%s_%s.json' % (runs_dir, precision, a))) for a in allocs}
m = runs['arena']['memory']
keys = ['params_bytes', 'grads_bytes', 'master_bytes', 'optimizer_bytes', 'staging_bytes', 'activation_peak_bytes',
        'bookkeeping_bytes', 'device_peak_bytes']
bad = [k for k in keys if plan[k] != m[k]] + (['reserved'] if plan['arena_block_bytes'] != m['reserved_bytes'] else [])
hashes = {a: r['final_params_hash'] for a, r in runs.items()}
if len(set(hashes.values())) != 1: bad.append('hashes %s' % hashes)
print(('ok' if not bad else 'DIFFERS ' + ' '.join(bad)) + '; peak reserved ' + ', '.join(
    '%s %.1f MiB' % (a, runs[a]['memory']['reserved_bytes'] / 1048576) for a in allocs))
PY
)
      case "$verdict" in
        ok*) ok "capacity $precision$(dry_note): the plan = the ledger to the byte, one hash for ${allocs// / = }${verdict#ok}" ;;
        *) bad "capacity $precision: $verdict" ;;
      esac
      on_gpu || not_run "capacity $precision: --alloc cuda (cudaMalloc per tensor) is the GPU's alone"
    else
      bad "capacity $precision: a run failed (log above)"
    fi
  done
  # 1 GiB per rank (it was 4 GiB): the same table, smaller micro-batches, a quarter of the time.
  if [ -n "$dry" ]; then
    not_run "superlinear: minutes of the simulated device on 2 cores at any size worth the name (make superlinear runs it on the CPU)"
  elif Z2_DEVICE=$dev timeout "$(scaled 150)" demos/superlinear.sh "$build" 1073741824 >"$work/superlinear.log" 2>&1 </dev/null; then
    cat "$work/superlinear.log"
    ok "superlinear (1 GiB per rank)$(dry_note): $(grep -E '^\| 2 \| 4 ' "$work/superlinear.log" | tr -s ' ')"
  else
    tail -n 8 "$work/superlinear.log"
    bad "superlinear (1 GiB per rank): demos/superlinear.sh failed or timed out (150 s)"
  fi
}

section_11() {
  local status
  Z2_VERIFY_FLAGS="--device $dev --comm mpi" timeout "$(scaled 150)" tests/verify.sh "$build" --all >"$work/verify.log" 2>&1 </dev/null
  status=$?
  grep -E '^(same|DIFFERS|FAILED)' "$work/verify.log" | cut -c1-160
  if [ "$status" -eq 0 ]; then
    ok "portable$(dry_note): $(tail -n 1 "$work/verify.log") (the CPU's table, N = 2 over MPI)"
  elif [ "$status" -eq 124 ]; then
    bad "portable: timed out after 150 s (the rows done are above)"
  else
    bad "portable: $(grep -c '^DIFFERS\|^FAILED' "$work/verify.log") row(s) differ from the CPU's table"
  fi
  # Over NCCL only the N = 1 rows can run (NCCL refuses two ranks on one GPU).
  if on_gpu; then
    { grep '^#' tests/golden_bits.txt; grep -v '^#' tests/golden_bits.txt | awk -F'|' '$3 + 0 == 1'; } >"$work/golden_n1.txt"
    if Z2_GOLDEN=$work/golden_n1.txt Z2_VERIFY_FLAGS="--device cuda --comm nccl" timeout "$(scaled 60)" tests/verify.sh "$build" \
         >"$work/verify_nccl.log" 2>&1 </dev/null; then
      ok "portable over NCCL: $(tail -n 1 "$work/verify_nccl.log") (the N = 1 rows)"
    else
      cat "$work/verify_nccl.log"
      bad "portable over NCCL (the N = 1 rows): differs or failed (above)"
    fi
  else
    not_run "portable over NCCL: the GPU's alone"
  fi
  if base_run && run_json portable_n1 "$trainer" "${base[@]}" --portable; then
    ok "portable step (BERT-mini N=1 stage 2 fp32, median)$(dry_note): $([ -n "$dry" ] && echo OpenBLAS || echo cuBLAS) $(median_ms n1_fp32) ms, zero2's kernel $(median_ms portable_n1) ms"
  else
    bad "portable step time: a run failed (log above)"
  fi
}

section_12() {
  local mem=("$trainer" --device "$dev" --comm "$nccl" --stage 2 --steps 1 --quiet) block start_ms
  local huge_status huge_ms under_status at_status node_status
  timeout "$(scaled 60)" "${mem[@]}" --plan --plan-world-sizes 1 --json "$work/mem_plan.json" >"$work/mem.log" 2>&1 </dev/null
  block=$(json "$work/mem_plan.json" "[r for r in d['plan'] if r['stage'] == 2][0]['arena_block_bytes']" 2>/dev/null)
  start_ms=$(date +%s%N)
  timeout "$(scaled 60)" "${mem[@]}" --layers 64 --hidden 8192 --heads 64 --intermediate 32768 --seq 32 \
    --micro-batch 1 >"$work/mem_huge.log" 2>&1 </dev/null
  huge_status=$? huge_ms=$((($(date +%s%N) - start_ms) / 1000000))
  ZERO2_MEMORY_LIMIT=$((${block:-0} - 1048576)) timeout "$(scaled 60)" "${mem[@]}" >"$work/mem_under.log" 2>&1 </dev/null
  under_status=$?
  ZERO2_MEMORY_LIMIT=$((2 * ${block:-0})) timeout "$(scaled 60)" "${mem[@]}" >"$work/mem_at.log" 2>&1 </dev/null
  at_status=$?
  mkdir -p "$work/nodes" && rm -f "$work/nodes/null"
  local node_made=yes
  mknod "$work/nodes/null" c 1 3 2>/dev/null || node_made=no
  timeout "$(scaled 60)" "${mem[@]}" --json "$work/nodes/null" >"$work/node.log" 2>&1 </dev/null
  node_status=$?
  local source_ok=yes
  if on_gpu; then grep -q "the GPU's free memory" "$work/mem_huge.log" || source_ok=no; fi
  if [ -n "$block" ] && [ "$huge_status" -eq 2 ] && [ $source_ok = yes ] && [ "$under_status" -eq 2 ] &&
     grep -q ZERO2_MEMORY_LIMIT "$work/mem_under.log" && [ "$at_status" -eq 0 ]; then
    ok "reliability$(dry_note): a 51.5B-parameter model refused in $huge_ms ms$(on_gpu && echo " against the GPU's free memory"); 1 MiB under the plan's block ($block bytes) refused, twice it trains"
  else
    tail -n 3 "$work/mem.log" "$work/mem_huge.log" "$work/mem_under.log" "$work/mem_at.log"
    bad "reliability: huge model exit $huge_status (the GPU's free memory named: $source_ok), under the block $under_status, twice the block $at_status"
  fi
  on_gpu || not_run "reliability: the refusal's source, the GPU's free memory (cudaMemGetInfo), is the GPU's alone"
  if [ $node_made = no ]; then
    not_run "reliability: an output naming a device node (mknod not permitted here)"
  elif [ "$node_status" -eq 2 ] && [ -c "$work/nodes/null" ]; then
    ok "reliability: --json naming a device node refused (exit 2), the node kept"
  else
    tail -n 3 "$work/node.log"
    bad "reliability: --json naming a device node: exit $node_status$([ -c "$work/nodes/null" ] || echo ', the node replaced')"
  fi
}

section_13() {
  local python
  for python in python3 /usr/bin/python3 ""; do "${python:-false}" -c 'import numpy' 2>/dev/null && break; done
  if [ -z "$python" ]; then
    not_run "traces: no python3 with numpy for tests/check_trace.py, not even the carried python3-numpy"
    return
  fi
  local t=$work/trace check_status split_same=yes file
  rm -rf "$t"_*
  tests/peers/reference_trace.sh "$trainer" "${t}_cpu" 1 --device cpu --accum 2 --micro-batch 2 >"$work/trace.log" 2>&1
  tests/peers/reference_trace.sh "$trainer" "${t}_gpu" 1 --device "$dev" --comm "$nccl" --accum 2 \
    --micro-batch 2 --init-hf "${t}_cpu/initial" >>"$work/trace.log" 2>&1
  tests/peers/reference_trace.sh "$trainer" "${t}_gpu2" 2 --device "$dev" --comm mpi --micro-batch 2 >>"$work/trace.log" 2>&1
  "$python" tests/check_trace.py "${t}_cpu" "${t}_gpu" >"$work/trace_check.log" 2>&1
  check_status=$?
  for file in $(cd "${t}_gpu" 2>/dev/null && find . -type f ! -name trace.json); do
    cmp -s "${t}_gpu/$file" "${t}_gpu2/$file" || split_same=no
  done
  if [ $check_status -eq 0 ] && cmp -s "${t}_cpu/initial/model.safetensors" "${t}_gpu/initial/model.safetensors" &&
     [ $split_same = yes ]; then
    ok "traces$(dry_note): the device's run (from the CPU trace's weights, --init-hf) against the CPU run: $(grep '^PASS' "$work/trace_check.log" | cut -c7-); (N, A) = (1, 2) and (2, 1) the same files"
  else
    tail -n 5 "$work/trace.log" "$work/trace_check.log"
    bad "traces: checker exit $check_status, splits the same: $split_same"
  fi
  rm -rf "$t"_*
}

section_14() {
  # N = 1 takes no collective and one GPU cannot hold two NCCL ranks, so NCCL with offload at N > 1 is not
  # run here. The plain fp32 and bf16 runs at N = 1 are section 5's and 7's (30 steps, the same flags).
  offload_key() {  # the plain run's key where another section made it
    case "$1" in "1 2 fp32") echo n1_fp32 ;; "1 2 bf16") echo mixed_bf16_2 ;; *) echo "$2" ;; esac
  }
  local config ranks comm stage precision plain_key
  for config in "1 $nccl 2 fp32" "1 $nccl 2 bf16" "2 mpi 1 bf16"; do
    read -r ranks comm stage precision <<<"$config"
    plain_key=$(offload_key "$ranks $stage $precision" "off_${ranks}_${stage}_${precision}_plain")
    # offload_pair names its runs KEY_plain and KEY_off; a plain run made elsewhere is linked in.
    local key=off_${ranks}_${stage}_${precision}
    if [ "$plain_key" != "${key}_plain" ]; then
      if [ "$plain_key" = n1_fp32 ]; then base_run; else run_json "$plain_key" "$trainer" "${base[@]}" --precision "$precision"; fi
      [ -s "$work/runs/$plain_key.json" ] && ln -sf "$plain_key.json" "$work/runs/${key}_plain.json"
    fi
    offload_pair "$key" "$ranks" "$comm" "$stage" "$precision" 30
  done
  # The host's threads (--host-threads): 1 against the default, this rank's share of the machine's cores;
  # one hash, and the offloaded optimizer step's time each way (notes/13's "whole step" on a GPU).
  local threaded=(--device "$dev" --comm "$nccl" --stage 2 --precision bf16 --steps 30 --quiet --offload-optimizer cpu
    --wall-clock-breakdown)
  if run_json off_threads_1 "$trainer" "${threaded[@]}" --host-threads 1 &&
    run_json off_threads_default "$trainer" "${threaded[@]}"; then
    local verdict
    verdict=$(python3 - "$work/runs/off_threads_1.json" "$work/runs/off_threads_default.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
median = lambda v: sorted(v)[len(v) // 2]
one, many = (median([s['optimizer_ms'] for s in r['steps']]) for r in (a, b))
same = a['final_params_hash'] == b['final_params_hash']
print('%s hash %s %s %s; optimizer step %.2f ms on 1 thread, %.2f on %d (1 / %d: %.2f)' % (
    'ok' if same else 'DIFFERS', a['final_params_hash'], '=' if same else '!=', b['final_params_hash'], one, many,
    b['host_threads'], b['host_threads'], one / many))
PY
)
    case "$verdict" in
      ok*) ok "ZeRO-Offload's host threads, N=1 stage 2 bf16$(dry_note): the same bits at 1 and the default:${verdict#ok}" ;;
      *) bad "ZeRO-Offload's host threads: $verdict" ;;
    esac
  else
    bad "ZeRO-Offload's host threads: a run failed (log above)"
  fi
}

# --- the modes -----------------------------------------------------------------------------------------------
if [ "$mode" = __step ]; then  # one step, in the session run_step made for it
  echo $$ >"$Z2_STEP_FILE.sid"
  mkdir -p "$work/runs"
  "$2"
  exit
fi

case "$mode" in
  quick) budget=${Z2_GPU_CHECK_BUDGET:-$((240 * scale))} ;;
  full) budget=${Z2_GPU_CHECK_BUDGET:-$((480 * scale))} ;;
  *) usage; [ -z "$mode" ] && exit 2; echo "tests/gpu_check.sh: unknown mode '$mode'"; exit 2 ;;
esac
started=$(date +%s)
on_gpu && { nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"; }
[ -n "$dry" ] && echo "DRY RUN (Z2_GPU_CHECK_DRY=1): no GPU; --device $dev for cuda, --comm $nccl for nccl, $build/"
# Each mode starts with a clean $work (full reads what its own section 3 logged, never quick's).
rm -rf "$work"
mkdir -p "$work/runs"

# quick's steps 1-3 are full's 0-2 (full's numbers are the sections the notes cite).
if [ "$mode" = quick ]; then run_here "1. the device" step_device; else run_here "0. the device" step_device; fi
if [ "$mode" = quick ]; then run_here "2. dependencies" step_dependencies; else run_here "1. dependencies" step_dependencies; fi
export cuda_arch
if grep -q '^FAILED|' "$work/step_2"; then summary; exit 1; fi
if [ "$mode" = quick ]; then
  run_step "3. build" 200 quick_build
  if grep -q '^FAILED|' "$work/step_3"; then summary; exit 1; fi
  run_step "4. doctest stage matrices" 90 quick_doctest
  run_step "5. make run on the GPU" 60 quick_make_run
  run_step "6. ZeRO-Offload's hash" 60 quick_offload
  run_step "7. sim against the GPU, portable" 60 quick_sim_vs_device
  run_step "8. timeline" 45 quick_timeline
else
  shift
  wanted=" ${*:-3 4 5 6 7 8 9 10 11 12 13 14} "
  # Section 3 runs last: it is the longest, and most of what it checks CI checks on the CPU too, so
  # where the budget runs short it is the suite that is cut, not a section only a GPU can run.
  run_step "2. build" 200 full_build
  if grep -q '^FAILED|' "$work/step_3"; then summary; exit 1; fi
  # name | limit (s): the limits sum past the budget; the budget stops what would not fit.
  while IFS='|' read -r number limit name; do
    [[ "$wanted" == *" $number "* ]] || continue
    run_step "$number. $name" "$limit" "section_$number"
  done <<'EOF'
4|60|the stage demo
5|45|BERT-mini timed
6|60|ZeRO-R
7|60|mixed precision
8|60|checkpoints
9|45|a DeepSpeed config
10|200|capacity and superlinear
11|180|portable bits
12|60|reliability
13|60|traces
14|90|ZeRO-Offload's step times
3|240|the suite on the device (doctest N = 1, 2, 4; tests/cli)
EOF
fi
summary
