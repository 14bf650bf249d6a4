#!/usr/bin/python3
"""notes/plot_timeline.py OUT.png STEP TITLE TIMELINE [TITLE TIMELINE ...] — one training step of --timeline
files (train_bert_mini --timeline FILE; notes/15-streams.md, "The timeline"), one panel per file.

Each panel shows step STEP (the "step STEP" span on each rank's host track) with a row per rank and track:
the compute, comm and copy streams, the collectives of each staging slot ("comm: slot k": a reduce-scatter
or an all-gather of one bucket, from when the comm stream may start it to when the host sees it done), and
the host (its waits for a stream, ZeRO-Offload's step). Slices are coloured by kind; a compute slice of
backward (its function's name says "backward") is darker than forward's. The x axis is the file's time
from the step's start: on --device sim a modelled device time (runtime/timeline.h).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLOURS = {"gemm": "#4c72b0", "loop": "#8fb1d9", "backward gemm": "#1f3f73", "backward loop": "#5a7fb0",
           "copy": "#55a868", "fill": "#b0b0b0", "reduce-scatter": "#c44e52", "all-gather": "#8172b2",
           "all-reduce": "#dd8452", "host loop": "#937860", "host wait": "#dddddd"}
ORDER = ["compute", "comm", "comm: slot 0", "comm: slot 1", "comm: slot 2", "copy", "host"]


def kind(event):
    if event["cat"] == "collective":
        return event["name"].split(" bucket")[0]
    if event["cat"] in ("gemm", "loop") and "backward" in event.get("args", {}).get("function", ""):
        return "backward " + event["cat"]
    return event["cat"]


def step_window(events, step):
    """Each rank's span of the step: {pid: (begin, end)} in microseconds."""
    return {e["pid"]: (e["ts"], e["ts"] + e["dur"]) for e in events
            if e["ph"] == "X" and e["cat"] == "step" and e["name"] == "step %d" % step}


def panel(axes, title, path, step):
    events = json.load(open(path))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    windows = step_window(events, step)
    rows = [(pid, name) for pid in sorted(windows) for name in ORDER if (pid, name) in
            {(p, n) for (p, _), n in threads.items()}]
    index = {row: k for k, row in enumerate(rows)}
    longest = 0.0
    for e in events:
        if e["ph"] != "X" or e["cat"] == "step" or e["pid"] not in windows:
            continue
        row = (e["pid"], threads[(e["pid"], e["tid"])])
        begin, end = windows[e["pid"]]
        if row not in index or e["ts"] + e["dur"] < begin or e["ts"] > end:
            continue
        start = (max(e["ts"], begin) - begin) / 1000.0
        width = max((min(e["ts"] + e["dur"], end) - max(e["ts"], begin)) / 1000.0, 1e-4)
        axes.broken_barh([(start, width)], (index[row] - 0.4, 0.8), facecolors=COLOURS.get(kind(e), "#999999"),
                         edgecolors="none")
        longest = max(longest, (end - begin) / 1000.0)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(["rank %d %s" % row for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, longest)
    axes.set_title(title, fontsize=10)
    axes.set_xlabel("ms from the start of step %d (modelled device time on --device sim)" % step, fontsize=8)
    axes.tick_params(axis="x", labelsize=8)


def main(out, step, *pairs):
    titles, paths = pairs[0::2], pairs[1::2]
    figure, axes = plt.subplots(len(paths), 1, figsize=(12, 3.2 * len(paths)), squeeze=False)
    for a, title, path in zip(axes[:, 0], titles, paths):
        panel(a, title, path, int(step))
    figure.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower center", ncol=11,
                  fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
