# tests/cli/common.sh — what every file of the command-line suite (tests/cli/*.sh) shares. Each file
# begins with
#     source "$(dirname "$0")/common.sh" "$@"
# and ends with `finish`. This file reads the build directory (the first argument, default build, relative
# to the repository's root, where the files run), makes a scratch directory ($work, removed at exit), and
# defines:
#   pass / fail MESSAGE         count one check ("PASS ..." / "FAIL ..." lines)
#   finish                      the plain closing line "N passed, M failed"; exit 1 if any failed
#   quick / all NAME            run the group of checks NAME (a function): `quick` always, `all` not under
#                               Z2_QUICK=1 (`make test`; `make test-all` and the file run alone run both);
#                               quick_only NAME: under Z2_QUICK=1 alone (a cheaper stand-in for an `all` group)
#   add_summary LOG LABEL       add a Python checker's own "N passed, M failed" line to the counts
#   json_get FILE EXPR          a Python expression over the JSON file, read as d
#   py FILE FUNCTION ARGS...    a function of tests/cli/FILE.py (the suite's Python, one file per capability)
#   same_bits_run LABEL N OUT FLAGS...  the tiny model on N ranks: its bits must be $reference's
#   bad_case EXPECT FLAGS...    a run that must refuse its input: one message, exit non-zero, nothing written
#   resumed_matches STRAIGHT RESUMED [skips]  "ok" when a resumed run's bits are the straight run's
#   torch_missing               true where torch is missing and Z2_NO_TORCH allows it (the GPU image)
# and the models the files train (tiny, small, tiny_run, ck, one_layer), and $work/corpus.txt.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${1:-build}
trainer="$build/train_bert_mini"
cli=tests/cli
PYTHON=/usr/bin/python3  # Debian's, which has python3-torch and numpy
export OPENBLAS_NUM_THREADS=1
[ -x "$trainer" ] || { echo "no $trainer: build it first (make)"; echo "0 passed, 1 failed"; exit 1; }
work=$(mktemp -d /tmp/z2_cli.XXXXXX)
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
}
quick() { "$1"; }
all() {
  if [ -n "${Z2_QUICK:-}" ]; then echo "    ($1: make test-all)"; else "$1"; fi
}
quick_only() {  # only under Z2_QUICK=1: a cheaper stand-in for a group that `all` runs
  if [ -n "${Z2_QUICK:-}" ]; then "$1"; fi
}
add_summary() {  # LOG LABEL: the log's last "N passed, M failed" line added in; none is one failure
  local line
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1)
  if [ -n "$line" ]; then
    passed=$((passed + $(echo "$line" | cut -d' ' -f1)))
    failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
  else
    fail "$2: no summary line"
  fi
}
py() { "$PYTHON" "$cli/$1.py" "${@:2}"; }
json_get() { py common get "$@"; }
resumed_matches() { py common resumed_matches "$@" 2>&1; }
torch_missing() { [ -n "${Z2_NO_TORCH:-}" ] && ! "$PYTHON" -c "import torch" 2>/dev/null; }

# A small text file, for the runs that need --data.
printf 'The quick brown fox jumps over the lazy dog. %.0s' $(seq 1 40) > "$work/corpus.txt"
# The tiny model: every part (2 blocks, 2 heads, several buckets), a run in a fraction of a second.
tiny=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2
      --steps 3 --warmup 1 --dropout 0.1 --clip 0.5 --bucket 3000 --quiet)
# The tiny model without the tiny run's dropout, clip and bucket (the reliability checks).
tiny_run=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --steps 3
          --warmup 1 --quiet)
# The model of the runs that train one step or refuse before it.
small=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --micro-batch 2 --steps 1)
# One block of 16, for the configs' and metrics' runs (the config gives the rest).
one_layer=(--layers 1 --hidden 16 --heads 2 --intermediate 32 --seq 16 --max-positions 20 --quiet)
# The checkpointed model (the steps and the saves are the caller's).
ck=(--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 --warmup 1 --quiet)
# fp16 whose scale doubles every 2 clean steps from 2^16: in 8 steps it overflows at steps 3 and 6
# (skipped) and changes scale throughout, so the part after a step-4 checkpoint holds a skip and scale
# changes. (zero_force_ds_cpu_optimizer false: offload.sh offloads it by flag, with the trainer's AdamW as
# the client's optimizer, which DeepSpeed refuses under offload without that key.)
echo '{"fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1},
      "zero_force_ds_cpu_optimizer": false}' > "$work/fp16_skips.json"
precision_flags() { case $1 in bf16) echo "--precision bf16";; fp16) echo "--config $work/fp16_skips.json";; esac; }

# same_bits_run LABEL N OUT FLAGS...: train the tiny model on N ranks with FLAGS, its summary into OUT,
# and compare its final hash and every step's loss bits with $reference (the first run sets it, and says so).
reference=""
same_bits_run() {
  local label=$1 ranks=$2 out=$3 bits
  shift 3
  if ! timeout 300 mpirun -n "$ranks" "$trainer" "${tiny[@]}" "$@" --json "$out" > "$work/log" 2>&1; then
    fail "$label: exit non-zero"; cat "$work/log"; return
  fi
  bits=$(json_get "$out" "d['final_params_hash'] + ' ' + ' '.join(s['loss_bits'] for s in d['steps'])")
  if [ -z "$bits" ]; then fail "$label: no hash in $out"; return; fi
  [ -z "$reference" ] && reference=$bits && reference_label=$label && echo "    reference ($label): $bits"
  # The claim each line proves: this run computes the reference run's bits (hash and every step's loss).
  if [ "$bits" = "$reference" ]; then pass "$label: the same bits as $reference_label"
  else fail "$label: $bits != $reference ($reference_label)"; fi
}
# A run whose bits are the reference, made without a check of its own (a file's prerequisite).
reference_run() {  # reference_run N OUT FLAGS...
  local ranks=$1 out=$2
  shift 2
  timeout 300 mpirun -n "$ranks" "$trainer" "${tiny[@]}" "$@" --json "$out" > "$work/log" 2>&1 ||
    { fail "the reference run ($*): exit non-zero"; cat "$work/log"; }
}

# bad_case EXPECT FLAGS...: one clear message from rank 0 holding EXPECT, a non-zero exit, no crash, no
# hang, no output file or temporary left behind. bad_ranks=K runs it on K ranks (default 2).
bad_case() {
  local expect=$1
  shift
  local out="$work/bad_out.json"
  rm -f "$out"
  # --json first: the case's own flags come later and win (the last value of a flag counts).
  timeout 60 mpirun -n "${bad_ranks:-2}" "$trainer" --json "$out" "$@" > "$work/bad_stdout" 2> "$work/bad_stderr"
  local status=$?
  local messages
  messages=$(grep -c "train_bert_mini: error:" "$work/bad_stderr")
  local label="bad input [$*]"
  if [ $status -eq 0 ]; then fail "$label: exit 0"
  elif [ $status -eq 124 ] || [ $status -eq 137 ]; then fail "$label: hung (timeout)"
  elif grep -qiE "segmentation|core dumped|terminate called|Assertion|BAD TERMINATION" "$work/bad_stderr"; then
    fail "$label: crashed: $(head -c 300 "$work/bad_stderr")"
  elif [ "$messages" != 1 ]; then
    fail "$label: $messages error messages (want exactly 1): $(head -c 300 "$work/bad_stderr")"
  elif ! grep -qF -- "$expect" "$work/bad_stderr"; then fail "$label: message lacks '$expect':" \
    "$(cat "$work/bad_stderr")"
  elif [ -e "$out" ] || [ -e "$work/no" ] || [ -n "$(find "$work" -name '*zero2-tmp*' | head -n 1)" ]; then
    fail "$label: left an output file or a temporary"
  else
    pass "one message, exit $status, nothing written: $label ->" \
      "$(sed 's/^train_bert_mini: error: //' "$work/bad_stderr" | head -c 110)"
  fi
}
