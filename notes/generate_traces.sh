#!/usr/bin/env bash
# notes/generate_traces.sh BUILD_DIR OUT_DIR — the measured blocks of notes/12 (and README's), one file
# per block in OUT_DIR, for notes/generate.sh (make notes) to paste; run alone to see them:
#   trace_size           a BERT-mini trace of 200 steps at N = 2, and what each of its parts weighs
#   check_peer_torch     make check-peer PEER=torch: the torch peer's two steps and the planted mistakes
#   check_trace_failure  tests/check_trace.py's whole output on one planted mistake
#   check_peer_fsdp, check_peer_large  make check-peer PEER=fsdp / PEER=large (SKIP without .venv-fsdp)
#   deepspeed_check      make check-peer PEER=deepspeed's check, step by step (SKIP without .venv-deepspeed)
#   deepspeed_side_by_side  its side by side (tests/peers/side_by_side.sh)
#   bug_taxonomy         tests/bug_taxonomy.py's classes by category and how the checker tells each
#   checker_corpus       tests/checker_corpus/run.sh dev, then held-out: the planted-bug corpus (about 15 min)
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-$(mktemp -d)}
trainer="$build/train_bert_mini"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

flags="--dropout 0 --steps 200 --trace-params-every 100 --quiet"
timeout 900 mpirun -n 2 "$trainer" $flags --trace "$work/trace" >/dev/null
{
  echo '```'
  echo "\$ mpirun -n 2 $trainer $flags --trace trace    # BERT-mini, its default sizes"
  echo "\$ du -sh trace/*"
  (cd "$work/trace" && du -sh -- * | sed 's/^/  /')
  kept=$(python3 -c 'import json, sys; t = json.load(open(sys.argv[1])); print(len(t["steps"]), "steps; parameters and gradients after steps", ", ".join(str(p["step"]) for p in t["parameter_steps"]))' "$work/trace/trace.json")
  echo "  total $(du -sh "$work/trace" | cut -f1): $kept"
  echo '```'
} >"$out/trace_size"

# peer_block PEER: make check-peer PEER=PEER's summary, its conformance table, into check_peer_PEER.
peer_block() {
  tests/peers/check_peer.sh "$1" "$build" >"$work/$1.log" 2>&1 || true
  {
    echo '```'
    echo "\$ make check-peer PEER=$1     # its summary: the conformance table, then the count"
    grep -E '^(FAIL|SKIP)|^[0-9]+ passed' "$work/$1.log" | fold -w 110 -s
    echo '```'
    echo
    sed -n '/^--- conformance$/,/^---$/p' "$work/$1.log" | sed '1d;$d'
  } >"$out/check_peer_$1"
}
peer_block torch

mistake=tests/lab_mistakes/torch-step.norm-own-shard.py
tests/peers/reference_trace.sh "$trainer" "$work/ref" 2
.venv-hf/bin/python tests/peers/torch_peer.py --nproc-per-node 2 --step flat --replace "$mistake" "$work/ref" \
  "$work/theirs" >/dev/null 2>&1
{
  echo '```'
  echo "\$ tests/peers/reference_trace.sh $trainer ref 2        # zero2's trace, N = 2"
  echo "\$ .venv-hf/bin/python tests/peers/torch_peer.py --nproc-per-node 2 --step flat --replace $mistake ref theirs"
  echo "\$ make check-trace REF=ref THEIRS=theirs"
  /usr/bin/python3 tests/check_trace.py "$work/ref" "$work/theirs" | sed "s|$work/||g" | fold -w 110 -s || true
  echo '```'
} >"$out/check_trace_failure"
# check_peer_fsdp, check_peer_large: make check-peer PEER=fsdp and PEER=large, their conformance tables (SKIP
# without .venv-fsdp, which PEER=fsdp makes from PyPI; PEER=large's torch peer runs in .venv-hf).
for peer in fsdp large; do
  if .venv-fsdp/bin/python -c 'import torch, transformers' >/dev/null 2>&1; then
    peer_block "$peer"
  else
    printf '```\nSKIP: no .venv-fsdp here (make check-peer PEER=fsdp makes it from PyPI)\n```\n' >"$out/check_peer_$peer"
  fi
done
# bug_taxonomy: tests/bug_taxonomy.py's classes per category and how each is told; checker_corpus: the
# generated corpus (tests/checker_corpus/run.sh dev, then held-out: about 15 minutes), its table per half.
/usr/bin/python3 - >"$out/bug_taxonomy" <<'PY'
import sys
sys.path.insert(0, "tests")
import bug_taxonomy as t
print("| category | classes | replayed | measured pattern | a recorded number | below a trace's power |")
print("|---|---|---|---|---|---|")
for category in t.CATEGORIES:
    classes = [c for c in t.CLASSES if c["category"] == category]
    count = lambda how: sum(c["how"] == how for c in classes)
    print(f"| {category} | {len(classes)} | {count('replay')} | {count('pattern')} | {count('scalar')} | {count('power')} |")
count = lambda how: sum(c["how"] == how for c in t.CLASSES)
print(f"| all | {len(t.CLASSES)} | {count('replay')} | {count('pattern')} | {count('scalar')} | {count('power')} |")
print()
print("| class | how | the mistake |")
print("|---|---|---|")
for c in t.CLASSES:
    print(f"| `{c['id']}` | {c['how']} | {c['summary']} |")
PY
for half in dev held-out; do
  TRAINER="$trainer" CORPUS_RESULTS="$work/corpus_$half" tests/checker_corpus/run.sh $half >"$work/corpus_$half.log" 2>&1 || true
done
{
  echo '```'
  for half in dev held-out; do
    echo "\$ TRAINER=$trainer tests/checker_corpus/run.sh $half    # its table and summary"
    sed -n "/^$half: /,\$p" "$work/corpus_$half.log" | grep -vE '^(FAIL|PASS) ' | grep -v '^$'
  done
  echo '```'
  echo
  echo "What did not pass, each with why:"
  echo
  echo '```'
  grep -hE '^FAIL ' "$work/corpus_dev.log" "$work/corpus_held-out.log" | cut -c1-200 || echo "(nothing)"
  echo '```'
} >"$out/checker_corpus"
if .venv-deepspeed/bin/python -c 'import deepspeed' >/dev/null 2>&1; then
  tests/peers/check_peer.sh deepspeed "$build" >"$work/deepspeed.log" 2>&1 || true
  {
    echo '```'
    echo "\$ make check-peer PEER=deepspeed    # its check"
    sed -n '/^--- the checker/,/^---$/p' "$work/deepspeed.log" | sed '1d;$d' | fold -w 110 -s
    grep -E '^(PASS|FAIL) DeepSpeed' "$work/deepspeed.log" | fold -w 110 -s
    echo '```'
  } >"$out/deepspeed_check"
  {
    echo '```'
    echo "\$ tests/peers/side_by_side.sh $build    # the end of make check-peer PEER=deepspeed"
    sed -n '/^zero2 (.*DeepSpeed/,$p' "$work/deepspeed.log" | grep -vE '^[0-9]+ passed, [0-9]+ failed$'
    echo '```'
  } >"$out/deepspeed_side_by_side"
else
  for block in deepspeed_check deepspeed_side_by_side; do
    printf '```\nSKIP: no .venv-deepspeed here (make check-peer PEER=deepspeed makes it from PyPI)\n```\n' >"$out/$block"
  done
fi
ls "$out"
