#!/usr/bin/python3
"""notes/plot_precision.py OUT.png FP32.json BF16.json FP16.json — the loss curves
of one training run in each precision (train_bert_mini --json summaries) in one
figure, with the bf16 and fp16 curves' difference from fp32 below. fp16's
skipped steps (a gradient overflowed: no update) are marked. Needs matplotlib
(make figures installs python3-matplotlib)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt

out, paths = sys.argv[1], sys.argv[2:5]
runs = [json.load(open(p)) for p in paths]
fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=120, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.4]})
colors = {"fp32": "black", "bf16": "tab:blue", "fp16": "tab:red"}
reference = {s["step"]: s["loss"] for s in runs[0]["steps"]}
for run in runs:
    p = run["precision"]
    steps = [s["step"] for s in run["steps"]]
    loss = [s["loss"] for s in run["steps"]]
    top.plot(steps, loss, color=colors[p], linewidth=1.0 if p != "fp32" else 1.6, alpha=0.85, label=p)
    skipped = [s["step"] for s in run["steps"] if s.get("skipped")]
    if skipped:
        top.scatter(skipped, [reference.get(k, 0) for k in skipped], marker="x", color=colors[p], s=18,
                    label=f"{p}: step skipped (overflow)")
    if p != "fp32":
        bottom.plot(steps, [s["loss"] - reference[s["step"]] for s in run["steps"]], color=colors[p], linewidth=0.9,
                    label=f"{p} - fp32")
top.set_ylabel("loss (nats per masked byte)")
top.legend(fontsize=8)
d = runs[0]
top.set_title(f"BERT-mini, stage {d['stage']}, N = {d['world_size']}, {d['device']}: the same training in three precisions",
              fontsize=9)
bottom.axhline(0, color="gray", linewidth=0.6)
bottom.set_ylabel("loss - fp32 loss")
bottom.set_xlabel("optimizer step")
bottom.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out)
print(f"wrote {out}")
