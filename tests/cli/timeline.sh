#!/usr/bin/env bash
# tests/cli/timeline.sh BUILD_DIR — --timeline FILE (runtime/timeline.h; notes/15-streams.md, "The
# timeline"): on --device sim at N = 2 the file parses, every event has its fields, each rank has one track
# per stream and the host's; in stage 2 with --overlap 1 a reduce-scatter overlaps backward's work in the
# modelled device time and with --overlap 0 none does (the paper's section 7.2, made visible); every wait is
# an arrow from a record to the waiting stream; the run's bits are the same with and without a timeline,
# on sim and cpu; cpu writes a valid file too; an output it cannot write is refused before step 1.
# Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

# Small buckets, so that several close during backward: the overlap has something to show.
timeline_flags=(--stage 2 --bucket 1024)

# timeline_run LABEL DEVICE OVERLAP: the tiny model on 2 ranks with a timeline, into $work/LABEL.json
# (the summary into $work/LABEL.summary.json).
timeline_run() {
  timeout 300 mpirun -n 2 "$trainer" "${tiny[@]}" "${timeline_flags[@]}" --device "$2" --overlap "$3" \
    --timeline "$work/$1.json" --json "$work/$1.summary.json" > "$work/log" 2>&1 ||
    { fail "$1: exit non-zero"; cat "$work/log"; }
}

verdict() {  # LABEL VERDICT: pass on "ok ...", else fail
  case "$2" in
    ok*) pass "$1: ${2#ok }";;
    *) fail "$1: $2";;
  esac
}

overlap_on_sim() {
  echo "=== the overlap in the modelled device time (--device sim, N = 2, stage 2)"
  timeline_run sim_overlap sim 1
  timeline_run sim_serial sim 0
  verdict "the file of a sim run at N = 2" "$(py timeline valid "$work/sim_overlap.json" 2 sim)"
  local on off
  on=$(py timeline overlapping "$work/sim_overlap.json")
  off=$(py timeline overlapping "$work/sim_serial.json")
  case "$on" in
    0\ of*) fail "--overlap 1: no reduce-scatter overlaps backward: $on";;
    [0-9]*) pass "--overlap 1: $on";;
    *) fail "--overlap 1: $on";;
  esac
  case "$off" in
    0\ of*) pass "--overlap 0: $off";;
    *) fail "--overlap 0: a reduce-scatter overlaps backward: $off";;
  esac
}

arrows() {
  [ -f "$work/sim_overlap.json" ] || timeline_run sim_overlap sim 1
  verdict "waits as arrows" "$(py timeline flows "$work/sim_overlap.json")"
}

# A timeline watches: the final hash and every step's loss bits are those of the run without one.
same_bits() {
  local device
  for device in sim cpu; do
    [ -f "$work/${device}_bits.json" ] || timeline_run "${device}_bits" "$device" 1
    reference_run 2 "$work/${device}_plain.json" "${timeline_flags[@]}" --device "$device" --overlap 1
    local with without
    with=$(json_get "$work/${device}_bits.summary.json" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
    without=$(json_get "$work/${device}_plain.json" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
    if [ -n "$with" ] && [ "$with" = "$without" ]; then pass "$device: the same bits with and without --timeline ($with)"
    else fail "$device: --timeline changed the bits: '$with' != '$without'"; fi
  done
  verdict "the file of a cpu run at N = 2" "$(py timeline valid "$work/cpu_bits.json" 2 cpu)"
}

refused() {
  bad_case "the directory '$work/no_such_directory' does not exist" "${small[@]}" \
    --timeline "$work/no_such_directory/timeline.json"
  bad_case "is a directory" "${small[@]}" --timeline "$work"
  bad_ranks=1 bad_case "name the same file" "${small[@]}" --json "$work/twice.json" --timeline "$work/twice.json"
}

quick overlap_on_sim
all arrows
all same_bits
all refused
finish
