#!/usr/bin/python3
"""notes/plot_loss.py RUN.json|METRICS.jsonl OUT.png — draw the loss curve of a
train_bert_mini run from its --json summary (every step) or its --metrics file
(every progress line, readable while the run goes on): the MLM loss per step
(left axis), the held-out loss of --eval-every as points, ln(260), the loss of
a uniform guess over the vocabulary, as a reference line, and the gradient norm
before clipping (right axis). Needs matplotlib (make figures
installs python3-matplotlib); run it with Debian's /usr/bin/python3."""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt

if sys.argv[1].endswith(".jsonl"):  # --metrics: skip a line a crash cut short
    records = []
    for line in open(sys.argv[1]):
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    # A resumed run appends after {"resumed_from", "step": s}: the lines
    # above it past step s are from a run that went on past that checkpoint.
    kept = []
    for r in records:
        if "resumed_from" in r:
            kept = [k for k in kept if k.get("step", 0) <= r["step"]]
        else:
            kept.append(r)
    records = kept
    trained = [r for r in records if "loss" in r]
    run = {"steps": trained, "eval": [{"step": r["step"], "loss": r["eval_loss"]} for r in records if "eval_loss" in r]}
else:
    run = json.load(open(sys.argv[1]))
steps = [s["step"] for s in run["steps"]]
loss = [s["loss"] for s in run["steps"]]
norm = [s["grad_norm"] for s in run["steps"]]
held_out = run.get("eval", [])

fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
ax.plot(steps, loss, color="tab:blue", label="MLM loss")
ax.axhline(math.log(260), color="gray", linestyle="--", linewidth=1, label="ln 260 (uniform guess)")
if held_out:
    ax.plot([e["step"] for e in held_out], [e["loss"] for e in held_out], "o", color="tab:green", markersize=4,
            label="held-out loss (--eval-every)")
ax.set_xlabel("optimizer step")
ax.set_ylabel("loss (nats per masked byte)")
right = ax.twinx()
right.plot(steps, norm, color="tab:orange", linewidth=0.8, alpha=0.7, label="gradient norm")
right.set_ylabel("gradient norm (before clipping)")
lines = ax.get_legend_handles_labels()
more = right.get_legend_handles_labels()
ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
where = f"stage {run['stage']}, N = {run['world_size']}, {run['device']}: " if "stage" in run else ""  # --json only
ax.set_title(f"BERT-mini, {where}{loss[0]:.2f} -> {loss[-1]:.2f} in {steps[-1]} steps", fontsize=9)
fig.tight_layout()
fig.savefig(sys.argv[2])
print(f"wrote {sys.argv[2]}")
