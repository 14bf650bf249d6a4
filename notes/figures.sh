#!/usr/bin/env bash
# notes/figures.sh BUILD_DIR — `make figures`: regenerate the pictures in notes/figures/.
#   bert_mini_run.json  the summary (--json) of `make run`'s training: BERT-mini,
#                       stage 2, 2 ranks, the embedded corpus, default settings
#   bert_mini_loss.png  its loss and gradient norm per step (notes/plot_loss.py)
# The JSON is kept beside the picture, so `notes/plot_loss.py` can redraw it
# without training again.
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
export OPENBLAS_NUM_THREADS=1
timeout 900 mpirun -n 2 "$build/train_bert_mini" --stage 2 --quiet --json notes/figures/bert_mini_run.json
/usr/bin/python3 notes/plot_loss.py notes/figures/bert_mini_run.json notes/figures/bert_mini_loss.png
