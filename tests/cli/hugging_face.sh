#!/usr/bin/env bash
# tests/cli/hugging_face.sh BUILD_DIR — the export through Hugging Face itself (tests/hf_roundtrip.py in
# .venv-hf, made by `make hf-venv`): AutoTokenizer gives the trainer's ids, AutoModelForMaskedLM the dumped
# loss, pipeline("fill-mask") runs; SKIP (not a pass) without the venv. Ends with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

round_trip() {
  echo "=== Hugging Face: AutoTokenizer, AutoModelForMaskedLM, pipeline('fill-mask') on the export"
  hf_python=.venv-hf/bin/python  # made by make test (hf-venv): transformers 4.39.3 on Debian's torch
  if ! [ -x "$hf_python" ] || ! "$hf_python" -c 'import transformers' 2>/dev/null; then
    echo "SKIP the Hugging Face round trip: no $hf_python with transformers" \
      "($(tail -n 1 .venv-hf.log 2>/dev/null || echo 'make hf-venv was not run'))"
  else
    rm -rf "$work/hf_dump"
    if timeout 120 "$trainer" --layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 32 \
      --max-positions 40 --micro-batch 4 \
         --accum 2 --steps 1 --dropout 0 --data "$work/corpus.txt" --dump-batch "$work/hf_dump" \
           --quiet > "$work/log" 2>&1 &&
       "$hf_python" tests/hf_roundtrip.py "$work/hf_dump" > "$work/hf.log" 2>&1 &&
       [ "$(grep -c '^PASS' "$work/hf.log")" -eq 5 ]; then
      pass "Hugging Face round trip:" \
        "$(grep '^PASS' "$work/hf.log" | sed 's/^PASS //' | cut -c1-70 | paste -sd ';' | cut -c1-330)"
    else fail "Hugging Face round trip: $(grep -E 'FAIL|Error' "$work/hf.log" | head -c 400)" \
      "$(head -c 200 "$work/log")"; fi
  fi
}

quick round_trip
finish
