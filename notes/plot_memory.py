#!/usr/bin/python3
"""notes/plot_memory.py TRACE_DIR OUT_DIR — the memory pictures of notes/04 and notes/05.

Reads the traces that `train_bert_mini --memory-trace FILE` writes (one line
per allocator event of the first step: live bytes, reserved bytes, live
activation bytes, pieces of free memory) from TRACE_DIR/memory_<activations>_<alloc>.csv
and draws:
  memory_keep_vs_offload.png   live activation memory over one step, keep / recompute / offload,
                               with the naive allocator (so every tensor counts from its first
                               write to its last read; the arena counts its carved buffers from
                               start-up)
  memory_naive_vs_arena.png    live memory, peak reserved so far, and pieces of free memory over
                               one step, naive vs arena (recompute)
  memory_caching_vs_arena.png  the same for caching (the model of PyTorch's caching allocator:
                               reserved = its segments) vs arena (recompute)
The x axis is the position in the step (allocator event k of n), because the
modes make different numbers of allocator calls.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

MiB = 1048576.0


def running_max(values):
    out, best = [], 0.0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def load(directory, activations, alloc):
    path = os.path.join(directory, f"memory_{activations}_{alloc}.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    n = max(len(rows) - 1, 1)
    return {
        "x": [int(r["event"]) / n for r in rows],
        "live": [int(r["live_bytes"]) / MiB for r in rows],
        "reserved": [int(r["reserved_bytes"]) / MiB for r in rows],
        # The peak so far: what the ledger's "reserved" is at that point of the step.
        "peak_reserved": running_max(int(r["reserved_bytes"]) / MiB for r in rows),
        "activations": [int(r["activation_bytes"]) / MiB for r in rows],
        "pieces": [int(r["free_pieces"]) for r in rows],
    }


def main():
    traces, out = sys.argv[1], sys.argv[2]

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for activations, style in (("keep", "-"), ("recompute", "--"), ("offload", ":")):
        t = load(traces, activations, "naive")
        ax.step(t["x"], t["activations"], style, where="post", label=f"--activations {activations}")
    ax.set_xlabel("position in one training step (allocator event k / n)")
    ax.set_ylabel("live activation memory (MiB)")
    ax.set_title("BERT-mini, one rank: activations over one step (each tensor from first write to last read)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory_keep_vs_offload.png"), dpi=110)

    for other, name in (("naive", "memory_naive_vs_arena.png"), ("caching", "memory_caching_vs_arena.png")):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for alloc, style in (("arena", "-"), (other, "--")):
            t = load(traces, "recompute", alloc)
            top.step(t["x"], t["peak_reserved"], style, where="post", linewidth=2,
                     label=f"--alloc {alloc}: peak reserved so far")
            top.step(t["x"], t["live"], style, where="post", alpha=0.45, label=f"--alloc {alloc}: live")
            bottom.step(t["x"], t["pieces"], style, where="post", label=f"--alloc {alloc}")
        top.set_ylabel("device memory (MiB)")
        top.set_title(f"BERT-mini, one rank, --activations recompute: {other} vs arena")
        top.legend(fontsize=8)
        bottom.set_ylabel("pieces of free memory")
        bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
        bottom.set_xlabel("position in one training step (allocator event k / n)")
        bottom.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)


if __name__ == "__main__":
    main()
