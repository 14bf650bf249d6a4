#!/usr/bin/env bash
# tests/cli/portable.sh BUILD_DIR — portable mode (--portable, notes/11): the default mode's hash follows the
# OpenBLAS kernel forced with OPENBLAS_CORETYPE, the portable hash stays one under every kernel and a glibc
# feature mask, equals the other build's, and the golden table (tests/verify.sh --all; a planted wrong row
# is caught); the config key (= the flag under the same config); a portable checkpoint resumed elsewhere;
# the stage / N / ZeRO-R matrix in portable mode, fp32, bf16 and fp16. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"
echo "=== portable mode: the same bits whatever OpenBLAS and glibc pick, in both builds; the golden table; the matrix"
# A tiny configuration: tests/golden_bits.txt's first row.
portable_tiny=(--layers 2 --hidden 64 --heads 2 --intermediate 128 --seq 32 --micro-batch 4 --steps 5 --quiet)
tiny_bits() {  # tiny_bits TRAINER ENV_ASSIGNMENT FLAGS...: "hash last-loss-bits", or "failed"
  local binary=$1 assignment=$2
  shift 2
  rm -f "$work/portable.json"
  if env $assignment timeout 120 mpirun -n 1 "$binary" "${portable_tiny[@]}" "$@" --json "$work/portable.json" \
      > "$work/log" 2>&1; then
    json_get "$work/portable.json" "d['final_params_hash'] + ' ' + d['steps'][-1]['loss_bits']"
  else
    echo failed
  fi
}
# The golden table's first row: its hash and last loss bits.
golden_first=$(grep -v '^#' "tests/golden_bits.txt" | head -n 1 |
  awk -F'|' '{gsub(/ /, "", $5); gsub(/ /, "", $6); print $5 " " $6}')

# OpenBLAS's kernel, forced (each is an sgemm with its own blocking and order;
# Sandybridge and Nehalem have no FMA), its thread count (the Haswell kernel
# splits the work differently on 2 threads), and glibc's CPU features masked
# (the variants of its functions it would pick). The default mode's bits follow
# OpenBLAS; portable mode calls neither.
# And zero2's own schedules, forced the same way (Z2_PORTABLE_LANES: the
# narrower ones this build has; they change only the portable mode).
kernels() {
  portable_lanes=""
  for lanes in 8 1; do
    Z2_PORTABLE_LANES=$lanes timeout 60 mpirun -n 1 "$trainer" "${portable_tiny[@]}" --steps 1 --portable \
      > /dev/null 2>&1 && portable_lanes="$portable_lanes Z2_PORTABLE_LANES=$lanes"
  done
  declare -A default_seen=()
  portable_seen=()
  # Only the kernels this CPU can run: OpenBLAS runs a forced kernel without
  # asking (SkylakeX's on a CPU without AVX-512 dies of SIGILL).
  cpu_flags=" $(grep -m 1 '^flags' /proc/cpuinfo) "
  forced_kernels=(OPENBLAS_CORETYPE=Sandybridge OPENBLAS_CORETYPE=Nehalem)
  [[ $cpu_flags == *" avx2 "* && $cpu_flags == *" fma "* ]] &&
    forced_kernels+=(OPENBLAS_CORETYPE=Haswell "OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=2")
  [[ $cpu_flags == *" avx512f "* ]] && forced_kernels+=(OPENBLAS_CORETYPE=SkylakeX)
  for variant in "OPENBLAS_CORETYPE=" "${forced_kernels[@]}" \
                 "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F,-AVX512VL" $portable_lanes; do
    default=$(tiny_bits "$trainer" "$variant")
    portable=$(tiny_bits "$trainer" "$variant" --portable)
    echo "    $variant: default $default, portable $portable"
    default_seen[$default]=1
    portable_seen+=("$portable")
  done
  Z2_PORTABLE_LANES=3 bad_case "Z2_PORTABLE_LANES=3: this build's portable CPU schedules have" "${small[@]}" --portable
  distinct_portable=$(printf '%s\n' "${portable_seen[@]}" | sort -u)
  [ ${#default_seen[@]} -ge 2 ] && [ -z "${default_seen[failed]:-}" ] &&
    pass "default mode: the forced OpenBLAS kernels give ${#default_seen[@]} different hashes (the bits follow the" \
      "machine)" ||
    fail "default mode: the forced OpenBLAS kernels gave ${#default_seen[@]} hash(es): ${!default_seen[*]} (nothing" \
      "to show)"
  [ "$(echo "$distinct_portable" | wc -l)" = 1 ] && [ "$distinct_portable" = "$golden_first" ] &&
    pass "portable mode: one hash under every OpenBLAS kernel, glibc mask and zero2 schedule ($portable_lanes), the" \
      "golden table's ($golden_first)" ||
    fail "portable mode: $(echo $distinct_portable) under the variants, the golden table has $golden_first"
}

# The other build (nvcc <-> g++), if it is there: the same portable bits.
cross_build() {
  other_build=$([ "$build" = build-cpu ] && echo build || echo build-cpu)
  if [ -x "$other_build/train_bert_mini" ]; then
    ours=$(tiny_bits "$trainer" "" --portable --precision bf16)
    theirs=$(tiny_bits "$other_build/train_bert_mini" "" --portable --precision bf16)
    [ "$ours" = "$theirs" ] && [ "$ours" != failed ] && pass "portable bf16: $build and $other_build give the same" \
      "bits ($ours)" ||
      fail "portable bf16: $build gives $ours, $other_build $theirs"
  else
    echo "    ($other_build/train_bert_mini not built: the cross-build check is the golden table's alone)"
  fi
}

# The config key, and its bad values. (A config means DeepSpeed's defaults
# for what it leaves out, notes/07, so the key is compared with the flag
# under the same, otherwise empty, config.)
config_key() {
  echo '{"zero2_portable": true}' > "$work/portable.json.cfg"
  echo '{}' > "$work/empty.json.cfg"
  by_flag=$(tiny_bits "$trainer" "" --config "$work/empty.json.cfg" --portable)
  by_key=$(tiny_bits "$trainer" "" --config "$work/portable.json.cfg")
  [ "$by_key" = "$by_flag" ] && [ "$by_key" != failed ] && \
    [ "$(json_get "$work/portable.json" "d['portable']")" = True ] &&
    pass "config \"zero2_portable\": true = --portable ($by_key)" ||
    fail "config zero2_portable: $by_key, --portable $by_flag"
  echo '{"zero2_portable": "yes"}' > "$work/portable_bad.json"
  bad_case "zero2_portable: wants true or false" "${small[@]}" --config "$work/portable_bad.json"
  bad_case "'--portable=1': --portable takes no value (write '--portable' to switch it on; a config file's" \
    "${small[@]}" --portable=1
  bad_case "--portable needs --collectives deterministic" "${small[@]}" --portable --collectives native
}

# A portable run saved and resumed (at another N and stage, no --portable on
# the command line: the checkpoint's mode continues) ends on the golden
# table's bits for the straight run; a checkpoint without the record (from
# before portable mode) loads in the default mode; a damaged record is named.
portable_resume() {
  golden_n2=$(grep -v '^#' "tests/golden_bits.txt" | grep '^tiny fp32, N=2, A=2 ' |
    awk -F'|' '{gsub(/ /, "", $5); print $5}')
  if timeout 120 mpirun -n 2 "$trainer" "${portable_tiny[@]}" --accum 2 \
    --portable --save "$work/portable_ck" --save-keep 3 \
       --save-every 2 > "$work/log" 2>&1 &&
     timeout 120 mpirun -n 4 "$trainer" --load "$work/portable_ck/step_2" --stage 1 \
       --quiet --json "$work/resumed.json" \
       > "$work/log" 2>&1; then
    resumed=$(json_get "$work/resumed.json" "d['final_params_hash'] + ' ' + str(d['portable'])")
    [ "$resumed" = "$golden_n2 True" ] && pass "portable: saved at step 2 (N=2 A=2), resumed at N=4 stage 1 = the" \
      "golden straight run ($resumed)" ||
      fail "portable resume: $resumed, the golden straight run $golden_n2"
  py common edit_json "$work/portable_ck/step_2/index.json" "del d['settings']['portable']"
    (cd "$work/portable_ck/step_2" && sha256sum index.json > index.sha256)  # edited on purpose: its digest made anew
    timeout 120 mpirun -n 4 "$trainer" --load "$work/portable_ck/step_2" --quiet --json "$work/resumed.json" \
      > "$work/log" 2>&1 &&
      [ "$(json_get "$work/resumed.json" "d['portable']")" = False ] &&
      pass "portable: a checkpoint without the record loads in the default mode" ||
      fail "portable: a checkpoint without settings.portable: $(head -c 300 "$work/log")"
  py common edit_json "$work/portable_ck/step_2/index.json" "d['settings']['portable'] = 'yes'"
    (cd "$work/portable_ck/step_2" && sha256sum index.json > index.sha256)  # edited on purpose: its digest made anew
    bad_ranks=4 bad_case 'settings.portable is "yes", not true or false' --load "$work/portable_ck/step_2"
  else
    fail "portable save / resume: a run failed: $(head -c 300 "$work/log")"
  fi
}

# tests/gpu_check.sh runs only where a GPU is lent: it must at least parse.
gpu_check_parses() {
  bash -n "tests/gpu_check.sh" 2> "$work/log" && pass "tests/gpu_check.sh parses (bash -n)" ||
    fail "tests/gpu_check.sh does not parse: $(head -c 300 "$work/log")"
}

# The golden table (tests/verify.sh, make verify), every row with make run's
# configuration; then a table with one row planted wrong must be caught.
golden_table() {  # [--all]: tests/verify.sh's small rows, or every row
  bash tests/verify.sh "$build" "$@" > "$work/verify.log" 2>&1
  verify_status=$?
  while read -r word rest; do
    case "$word" in
      same) pass "golden table: $rest";;
      DIFFERS|FAILED) fail "golden table: $word $rest";;
    esac
  done < "$work/verify.log"
  [ $verify_status -eq 0 ] && pass "golden table: $(tail -n 1 "$work/verify.log")" || fail "golden table:" \
    "$(tail -n 1 "$work/verify.log")"
}

golden_planted() {
  sed '0,/^[^#]/s/| \([0-9a-f]\{16\}\) |/| 0123456789abcdef |/' "tests/golden_bits.txt" > "$work/golden_planted.txt"
  Z2_GOLDEN="$work/golden_planted.txt" bash "tests/verify.sh" "$build" > "$work/verify.log" 2>&1
  planted_status=$?
  [ $planted_status -ne 0 ] && grep -q "^DIFFERS tiny fp32, N=1: this build gives $golden_first" "$work/verify.log" &&
    grep -q "does NOT compute zero2's reference bits: 1 of" "$work/verify.log" &&
    pass "golden table: a planted wrong hash is named, exit $planted_status" ||
    fail "golden table: the planted row was not caught (exit $planted_status): $(tail -n 2 "$work/verify.log")"
}

# The bitwise matrix in portable mode: each precision one hash across N, A,
# stage and ZeRO-R (poisoned activations), as in the default mode.
portable_matrix() {
  for precision in fp32 bf16 fp16; do
    reference=""
    for N in 1 2 4; do
      for stage in 0 1 2; do
        [ $precision != fp32 ] && [ $(( (N + stage) % 2 )) = 1 ] && continue  # 16-bit: a subset of the (N, stage)
        same_bits_run "portable $precision N=$N A=$((4 / N)) stage=$stage" $N "$work/portable_matrix.json" --portable \
          --precision $precision --accum $((4 / N)) --stage $stage
      done
    done
    # ZeRO-R: fp32 every --activations x --alloc at N = 2, stage 2; 16-bit two of them.
    for activations in keep recompute offload; do
      for alloc in arena naive caching; do
        case "$precision $activations $alloc" in
          fp32*|*"offload naive"|*"recompute caching") ;;
          *) continue;;
        esac
        same_bits_run "portable $precision N=2 stage 2 --activations $activations --alloc $alloc (poisoned)" 2 \
          "$work/portable_matrix.json" --portable --precision $precision --accum 2 --stage 2 \
            --activations $activations \
          --alloc $alloc --poison-activations
      done
    done
  done
}

golden_small() { golden_table; }
golden_all() { golden_table --all; }

quick kernels
quick_only golden_small
all golden_all
all golden_planted
quick portable_matrix
all cross_build
all config_key
all portable_resume
all gpu_check_parses
finish
