#!/usr/bin/env bash
# tests/checker_corpus/run.sh [dev|held-out|all] [--quick] — the planted-bug corpus (tests/checker_corpus/
# generate.py) run through tests/check_trace.py and scored (score.py; README.md says what each column means).
#
# For each case of the half: zero2's reference trace of its configuration (tests/peers/reference_trace.sh, made
# once per configuration and trainer and kept in $CORPUS_CACHE), the torch peer's replay (the case's planted
# copy of tests/peers/torch_peer.py, or the peer itself for a correct case; its ranks forked by forked_ranks.py),
# then /usr/bin/python3 tests/check_trace.py REF THEIRS. One peer at a time. --quick: the cases generate.py marks
# quick (each category's first mistake, and a few correct replays).
#
#   TRAINER        zero2's trainer (build-cpu/train_bert_mini)
#   PEER_PYTHON    the Hugging Face venv's python (.venv-hf/bin/python)
#   CORPUS_CACHE   where reference traces are kept (/tmp/z2_checker_corpus)
#   CORPUS_RESULTS where this run's logs and results.tsv go (a new directory under $CORPUS_CACHE/results)
#
# Ends with score.py's tables and "N passed, M failed"; exit status 0 when none failed.
set -u
cd "$(dirname "$0")/../.."
half=all quick=0
for arg in "$@"; do
  case $arg in
    dev|held-out|all) half=$arg ;;
    --quick) quick=1 ;;
    *) echo "usage: tests/checker_corpus/run.sh [dev|held-out|all] [--quick]"; exit 2 ;;
  esac
done
trainer=${TRAINER:-build-cpu/train_bert_mini}
python=${PEER_PYTHON:-.venv-hf/bin/python}
cache=${CORPUS_CACHE:-/tmp/z2_checker_corpus}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1
[ -x "$trainer" ] || { echo "run.sh: no trainer at $trainer (make build-cpu/train_bert_mini, or TRAINER=...)"; exit 2; }
"$python" -c 'import torch, transformers' 2>/dev/null ||
  { echo "run.sh: $python cannot import torch and transformers (make hf-venv, or PEER_PYTHON=...)"; exit 2; }
/usr/bin/python3 tests/checker_corpus/generate.py check > /dev/null ||
  { /usr/bin/python3 tests/checker_corpus/generate.py check | grep -v '^[0-9]* cases'; echo "(those cases will be errors)"; }
# The recorded split must be the rule's (split.json is committed before anyone tunes against a half).
/usr/bin/python3 - <<'PY' || exit 2
import json, sys
sys.path.insert(0, "tests/checker_corpus")
from generate import all_cases
split = json.load(open("tests/checker_corpus/split.json"))
recorded = {i: h for h in ("dev", "held-out") for i in split[h]}
wrong = [c["id"] for c in all_cases() if c["id"] in recorded and recorded[c["id"]] != c["half"]]
if wrong:
    sys.exit(f"run.sh: split.json disagrees with the hash rule for {wrong[:3]}")
new = [c["id"] for c in all_cases() if c["id"] not in recorded]
if new:
    print(f"run.sh: {len(new)} cases not in split.json (placed by the rule): {new[:3]}")
PY
key=$(cat "$trainer" tests/peers/reference_trace.sh | sha256sum | cut -c1-12)
mkdir -p "$cache/refs" "$cache/results"
results=${CORPUS_RESULTS:-$(mktemp -d "$cache/results/$(date -u +%Y%m%dT%H%M%S)-$half.XXXX")}
mkdir -p "$results"
: > "$results/results.tsv"
work=$(mktemp -d /tmp/z2_corpus_run.XXXXXX)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
n=0
while IFS=$'\t' read -r -u 3 id config step precision ranks kind is_quick edits flags; do  # fd 3: mpirun reads stdin
  [ "$quick" = 1 ] && [ "$is_quick" = 0 ] && continue
  n=$((n + 1))
  ref="$cache/refs/$config-$key"
  if [ ! -f "$ref/trace.json" ]; then  # made aside, then moved: a half-made trace is never taken for one
    rm -rf "$ref.tmp.$$"
    # shellcheck disable=SC2086  # the configuration's flags, split on purpose
    if tests/peers/reference_trace.sh "$trainer" "$ref.tmp.$$" "$ranks" $flags > "$work/reference.log" 2>&1 < /dev/null &&
       [ -f "$ref.tmp.$$/trace.json" ]; then
      rm -rf "$ref" && mv "$ref.tmp.$$" "$ref"
    else
      echo "run.sh: zero2's trace $config could not be made:"; tail -n 5 "$work/reference.log"
      rm -rf "$ref.tmp.$$"
    fi
  fi
  log="case$n.log"
  case_start=$(date +%s.%N)
  peer=tests/peers/torch_peer.py peer_status=0
  if [ "$edits" != 0 ]; then
    peer="$work/peer.py"
    /usr/bin/python3 tests/checker_corpus/generate.py plant "$id" "$peer" 2> "$results/$log" || peer_status=3
  fi
  check_status=-
  if [ $peer_status = 0 ] && [ -f "$ref/trace.json" ]; then
    rm -rf "$work/theirs"
    timeout 600 "$python" tests/checker_corpus/forked_ranks.py "$peer" --nproc-per-node "$ranks" --step "$step" \
      --precision "$precision" "$ref" "$work/theirs" > "$work/peer.log" 2>&1 < /dev/null
    peer_status=$?
    if [ $peer_status = 0 ]; then
      /usr/bin/python3 tests/check_trace.py "$ref" "$work/theirs" > "$results/$log" 2>&1
      check_status=$?
    else
      tail -n 20 "$work/peer.log" > "$results/$log"
    fi
  elif [ $peer_status = 0 ]; then
    peer_status=2
  fi
  seconds=$(echo "$(date +%s.%N) - $case_start" | bc)
  printf '%s\t%s\t%s\t%.1f\t%s\n' "$id" "$peer_status" "$check_status" "$seconds" "$log" >> "$results/results.tsv"
  printf '%4d %-70s peer %s, checker %s, %5.1f s: %s\n' "$n" "$id" "$peer_status" "$check_status" "$seconds" \
    "$(grep -m1 -E '^(PASS|FAIL)' "$results/$log" | cut -c1-60)"
done 3< <(/usr/bin/python3 tests/checker_corpus/generate.py tsv "$half")
echo "$n cases in $(( $(date +%s) - start )) s; logs in $results"
/usr/bin/python3 tests/checker_corpus/score.py "$results"
