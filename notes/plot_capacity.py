#!/usr/bin/python3
"""notes/plot_capacity.py PLAN_JSON MEASURED_DIR SUPERLINEAR_JSON OUT_DIR — the pictures of notes/10.

  capacity_by_stage.png   the paper's Figure 1 for BERT-mini: bytes per rank by category
                          (parameters, gradients, fp32 master, AdamW m and v, staging,
                          activations, bookkeeping) for stages 0, 1, 2 at each N of
                          PLAN_JSON (train_bert_mini --plan --json), stacked; a marker on a
                          bar is the device peak a real run measured
                          (MEASURED_DIR/capacity_measured_<stage>_<N>.json, --json of one step)
  superlinear.png         aggregate tokens/s against N for stages 0 and 2 at the largest
                          micro-batch each fits in the same bytes per rank
                          (SUPERLINEAR_JSON, written by demos/superlinear.sh), beside
                          linear scaling from stage 0 at N = 1
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 1048576.0
CATEGORIES = [("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("master_bytes", "fp32 master"),
              ("optimizer_bytes", "AdamW m, v"), ("staging_bytes", "staging"),
              ("activation_peak_bytes", "activations"), ("bookkeeping_bytes", "bookkeeping")]


def capacity(plan_path, measured_dir, out):
    plan = json.load(open(plan_path))
    sizes = sorted({r["world_size"] for r in plan["plan"]})
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width, x, ticks, labels = 0.8, 0, [], []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n in sizes:
        for stage in (0, 1, 2):
            row = [r for r in plan["plan"] if r["world_size"] == n and r["stage"] == stage][0]
            bottom = 0.0
            for k, (key, name) in enumerate(CATEGORIES):
                value = row[key] / MiB
                ax.bar(x, value, width, bottom=bottom, color=colors[k % len(colors)],
                       label=name if (n, stage) == (sizes[0], 0) else None)
                bottom += value
            measured = os.path.join(measured_dir, f"capacity_measured_{stage}_{n}.json")
            if os.path.exists(measured):
                peak = json.load(open(measured))["memory"]["device_peak_bytes"] / MiB
                ax.plot([x], [peak], "k_", markersize=18, markeredgewidth=2.5,
                        label="measured device peak" if (n, stage) == (sizes[0], 0) else None)
            ticks.append(x)
            labels.append(f"{stage}\nN={n}" if stage == 1 else f"{stage}")
            x += 1
        x += 0.6
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("bytes per rank (MiB)")
    ax.set_title(f"BERT-mini ({plan['params']:,} parameters, {plan['precision']}, --activations "
                 f"{plan['activations']}, micro-batch {plan['micro_batch']}): the plan by stage and N")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "capacity_by_stage.png"), dpi=110)


def superlinear(path, out):
    rows = json.load(open(path))["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    base = [r for r in rows if r["stage"] == 0 and r["world_size"] == 1][0]["aggregate_tokens_per_s"]
    sizes = sorted({r["world_size"] for r in rows})
    left.plot(sizes, [base * n for n in sizes], "k:", label="linear from stage 0, N = 1")
    for k, (stage, style) in enumerate(((0, "o-"), (2, "s-"))):
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["world_size"])
        left.plot([r["world_size"] for r in mine], [r["aggregate_tokens_per_s"] for r in mine], style,
                  label=f"stage {stage}")
        right.bar([sizes.index(r["world_size"]) + (k - 0.5) * 0.38 for r in mine], [r["micro_batch"] for r in mine],
                  0.38, label=f"stage {stage}")
    left.set_xticks(sizes)
    left.set_xlabel("ranks N")
    left.set_ylabel("aggregate tokens/s")
    left.set_title(f"throughput at the largest micro-batch ({rows[0]['cores']} cores)", fontsize=10)
    left.legend(fontsize=8)
    right.set_xticks(range(len(sizes)))
    right.set_xticklabels([f"N = {n}" for n in sizes])
    right.set_ylabel("largest micro-batch (sequences)")
    right.set_title(f"what {rows[0]['limit_bytes'] / MiB:.0f} MiB per rank holds (--plan, checked by a run)",
                    fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "superlinear.png"), dpi=110)


def main():
    plan, measured, speed, out = sys.argv[1:5]
    capacity(plan, measured, out)
    superlinear(speed, out)


if __name__ == "__main__":
    main()
