#!/usr/bin/env bash
# tests/cli/torch_reference.sh BUILD_DIR — the PyTorch reference (tests/torch_reference.py) on a batch the
# trainer dumped: the loss, every gradient and one AdamW step against torch's, then the reference's own
# self-test (its file I/O and each of its checks failing on a planted fault, so a passing comparison means
# something). The 16-bit steps against fp64 and torch.autocast are precision.sh's. Ends with
# "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

reference() {
  echo "=== PyTorch reference: loss, every gradient and one AdamW step on a dumped batch"
  if torch_missing; then
    echo "SKIP torch reference: no torch here and Z2_NO_TORCH is set (the GPU image; make deps installs python3-torch)"
  elif ! "$PYTHON" -c "import torch" 2>/dev/null; then
    fail "torch reference: $PYTHON cannot import torch (make deps installs python3-torch)"
  elif timeout 300 mpirun -n 1 "$trainer" --layers 2 --hidden 64 --heads 4 --intermediate 128 --seq 32 \
         --max-positions 40 --micro-batch 4 --accum 2 --steps 1 --dropout 0 --clip 0.5 --lr 1e-3 --weight-decay 0.01 \
         --seed 3 --quiet --dump-batch "$work/dump" --export-hf "$work/after" > "$work/log" 2>&1; then
    "$PYTHON" tests/torch_reference.py check "$work/dump" "$work/after" > "$work/torch.log" 2>&1
    cat "$work/torch.log"
    add_summary "$work/torch.log" "torch reference"
  else
    fail "torch reference: the dump run failed"; cat "$work/log"
  fi
}

selftest() {
  if torch_missing; then
    echo "SKIP torch reference selftest (no torch here)"
  elif "$PYTHON" tests/torch_reference.py selftest > "$work/selftest.log" 2>&1; then
    pass "torch reference selftest: $(tail -n 1 "$work/selftest.log")"
  else
    fail "torch reference selftest"; cat "$work/selftest.log"
  fi
}

quick reference
all selftest
finish
