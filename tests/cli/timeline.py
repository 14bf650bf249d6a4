"""tests/cli/timeline.py — verdicts over --timeline files (tests/cli/timeline.sh). Each prints one line
starting with "ok" or "bad"; notes/plot_timeline.py draws the same files."""
import json
import sys

REQUIRED = {"X": ("name", "cat", "ph", "pid", "tid", "ts", "dur"), "s": ("name", "cat", "ph", "id", "pid", "tid", "ts"),
            "f": ("name", "cat", "ph", "id", "pid", "tid", "ts"), "M": ("name", "ph", "pid", "args")}


def load(path):
    return json.load(open(path))["traceEvents"]


def names(events):
    """{(pid, tid): thread name} and {pid: process name}."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return threads, processes


def slices(events, track_name, threads):
    return [e for e in events if e["ph"] == "X" and threads.get((e["pid"], e["tid"])) == track_name]


def valid(path, ranks, device):
    """The file parses, every event has its phase's fields, a rank is a process "rank N", and on sim and cuda
    each rank has one track per stream and the host's (on cpu: one track for the streams, and the host's)."""
    events = load(path)
    missing = [e for e in events if e.get("ph") not in REQUIRED or any(k not in e for k in REQUIRED[e["ph"]])]
    negative = [e for e in events if e["ph"] == "X" and (e["dur"] < 0 or e["ts"] < 0)]
    threads, processes = names(events)
    ranks = int(ranks)
    want = ["compute", "comm", "copy", "host"] if device != "cpu" else ["cpu (every stream, at once)", "host"]
    bad_tracks = [r for r in range(ranks) if sorted(n for (p, _), n in threads.items() if p == r and
                                                     not n.startswith("comm: slot")) != sorted(want)]
    ok = (not missing and not negative and sorted(processes) == list(range(ranks))
          and all(processes[r] == "rank %d" % r for r in range(ranks)) and not bad_tracks)
    print(("ok" if ok else "bad") + " %d events, %d ranks (%s), tracks per rank %s; %d without their fields, %d "
          "negative, ranks with other tracks %s" % (len(events), len(processes), ", ".join(sorted(processes.values())),
                                                   want, len(missing), len(negative), bad_tracks))


def overlapping(path):
    """How many reduce-scatter spans (on a comm slot's track) overlap, in time, a backward loop or gemm on the
    same rank's compute track by more than 10 ns (the file's times are rounded to 1 ns: two slices that
    touch may seem to overlap by one): the section 7.2 overlap."""
    events = load(path)
    threads, _ = names(events)
    spans = [e for e in events if e["ph"] == "X" and e["name"].startswith("reduce-scatter")
             and threads.get((e["pid"], e["tid"]), "").startswith("comm: slot")]
    backward = [e for e in slices(events, "compute", threads) if "backward" in e.get("args", {}).get("function", "")]
    count = 0
    for s in spans:
        if any(b["pid"] == s["pid"] and b["ts"] < s["ts"] + s["dur"] - 0.01 and s["ts"] < b["ts"] + b["dur"] - 0.01
               for b in backward):
            count += 1
    print("%d of %d reduce-scatter spans overlap backward work (%d backward slices)" % (count, len(spans), len(backward)))


def flows(path):
    """Every wait is an arrow: an "s" inside a slice of the recording stream's track (where the awaited work ends),
    its "f" on another track of the same rank, not earlier (a viewer binds it to the next slice there)."""
    events = load(path)
    by_track = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    bad = []
    for id_, s in starts.items():
        f = ends.get(id_)
        inside = any(x["ts"] <= s["ts"] <= x["ts"] + x["dur"] for x in by_track.get((s["pid"], s["tid"]), []))
        if f is None or not inside or f["pid"] != s["pid"] or f["tid"] == s["tid"] or f["ts"] < s["ts"]:
            bad.append(id_)
    ok = starts and not bad and len(starts) == len(ends)
    print(("ok" if ok else "bad") + " %d arrows from a record to a wait, %d ends; %d malformed" % (len(starts), len(ends), len(bad)))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
