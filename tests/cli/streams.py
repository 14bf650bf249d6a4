"""tests/cli/streams.py — the simulated device's mutation test (tests/cli/streams.sh runs it; notes/15-streams.md).

    streams.py sites                 every site that orders streams, read from the sources: FILE:LINE kind
                                     function call (the record, wait, synchronize and synchronize_all calls)
    streams.py mutation BUILD [TABLE]  each site skipped in turn (Z2_SIM_SKIP) on --device sim, over the
                                     configs that reach it: its bits must change, or the run must stop (a
                                     race report, a refusal); a site that changes nothing must be explained
                                     below (EXPLAINED), and one no config reaches too. PASS/FAIL lines, the
                                     plain "N passed, M failed"; TABLE: its rows (JSON), for the table
    streams.py table TABLE           the table notes/generate.sh puts in notes/15, from a mutation run's TABLE
    streams.py replace FILE OLD NEW [OLD NEW ...]  a planted mistake (streams.sh): each OLD, found exactly
                                     once, replaced by its NEW in turn; exit 1 if one is not

The sites are found, not listed: a new wait in the code is a new row of the test at once. A site is named
in EXPLAINED by its file, the function it is in and what it calls, "zero2.cu wait_for_all_gathers wait"
(line numbers move; those rarely do).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Where stream work is ordered: the engine, the runtime, the trainer. (The simulated device itself only
# implements the calls; the doctest suite's files are not among the trainer's.)
SOURCE_PATTERNS = ["zero2.cu", "runtime/*.h", "runtime/*.cpp", "train_bert_mini.cu", "trainer/*.cpp"]
NOT_SITES = {"runtime/simulated_device.cpp", "runtime/simulated_device.h"}
# A call: obj.record( / obj->wait( / a bare synchronize( inside Compute's own files. Not a definition
# (Compute::record), not MPI_Wait or wait_until (a word character or ':' before the name).
CALL = re.compile(r"(?:^|[^\w:])((?:\w+(?:\.|->))?)(record|wait|synchronize_all|synchronize)\(")


def enclosing_function(lines, index):
    """The name of the function whose body holds lines[index]: the nearest line above, at the margin (or a
    struct's), that begins a signature: a name and '(' there, and a '{' before any ';' (over a few lines)."""
    start = re.compile(r"^ {0,2}(?=[\w~])(?!(?:if|for|while|switch|return|else|case|do|struct|class)\b)")
    for k in range(index, -1, -1):
        if not start.match(lines[k]) or "(" not in lines[k]:
            continue
        text = " ".join(lines[k:k + 5])
        cut = re.search(r"[;{]", text)
        name = re.search(r"(~?\w+)\s*\(", text)
        if cut and cut.group() == "{" and name and name.start() < cut.start():
            return name.group(1)
    return "?"


def sites():
    """Every ordering call in the sources, in file order: dicts of file, line, kind, function, call, key."""
    found = []
    files = [f for p in SOURCE_PATTERNS for f in sorted(glob.glob(p))]
    for path in files:
        if path in NOT_SITES:
            continue
        lines = open(path).read().split("\n")
        for index, line in enumerate(lines):
            code = line.split("//")[0]
            m = CALL.search(code)
            # A call that passes its caller's `site` on is the backend forwarding one (compute.cpp), and a
            # declaration names `Site site`: neither is a site of its own.
            if not m or re.search(r"\bsite\b", code):
                continue
            call = code.strip().rstrip(";")
            found.append({"file": path, "line": index + 1, "kind": m.group(2),
                          "function": enclosing_function(lines, index), "call": call})
    seen = {}
    for s in found:  # the key: file, function, what it calls (and which of several: #2, #3)
        base = f"{s['file']} {s['function']} {s['kind']}"
        seen[base] = seen.get(base, 0) + 1
        s["key"] = base if seen[base] == 1 else f"{base} #{seen[base]}"
        s["where"] = f"{s['file']}:{s['line']}"
    return found


def print_sites():
    for s in sites():
        print(f"{s['where']:32} {s['kind']:16} {s['function']:28} {s['call']}")


# --- the configs: the tiny model (common.sh's tiny_run), each reaching its own sites -------------------
TINY_RUN = ("--layers 2 --hidden 32 --heads 2 --intermediate 64 --seq 16 --max-positions 20 --micro-batch 2 "
            "--steps 3 --warmup 1 --quiet").split()
# name, ranks, flags ({dir}: a fresh empty directory per run; {checkpoint}: one saved before, on cpu).
# Small buckets (3000 elements): several buckets, and stage 2's two slots taken again within a backward.
CONFIGS = [
    ("stage 2", 2, "--stage 2 --bucket 3000"),
    # One bucket: backward's work stays queued until the bucket is complete (a small bucket's
    # reduce-scatter makes the host run it block by block), so a checkpoint's copy back can overtake it.
    ("stage 2, bf16, activations offloaded, one bucket", 2, "--stage 2 --precision bf16 --activations offload"),
    ("stage 1, optimizer offloaded", 2, "--stage 1 --offload-optimizer cpu --bucket 3000"),
    ("stage 2, fp16, optimizer offloaded, A = 2, no overlap", 2,
     "--stage 2 --precision fp16 --offload-optimizer cpu --accum 2 --overlap 0 --bucket 3000"),
    ("stage 0, A = 2, recompute", 2, "--stage 0 --accum 2 --activations recompute --bucket 3000"),
    ("stage 2, bf16, resumed and saved", 2,
     "--stage 2 --precision bf16 --bucket 3000 --load {checkpoint} --save {dir}"),
    ("stage 1, traced", 2, "--stage 1 --bucket 3000 --trace {dir} --trace-params-every 1"),
    ("stage 2, timed", 2, "--stage 2 --bucket 3000 --wall-clock-breakdown"),
    ("one rank, bf16, batch dumped", 1, "--stage 2 --precision bf16 --bucket 3000 --dump-batch {dir}"),
    # Gradients whose fp32 squares overflow (tests/cli/reliability.sh's case): the norm taken again, scaled.
    ("stage 1, squares overflow (dropout 0.99)", 2, "--stage 1 --bucket 3000 --dropout 0.99"),
]
# The checkpoint the resumed config loads: 2 of its 3 steps (saved on cpu, once).
CHECKPOINT_FLAGS = "--stage 2 --precision bf16 --bucket 3000 --steps 2 --save {dir}"

# Sites that change nothing when skipped alone, and why. masked_by: the site whose wait does the same work
# later (skipping both must then be caught: the test checks it), or None where nothing can: why says.
TEARDOWN = ("the last drain before memory goes: in a run that ends cleanly nothing is queued by then (the final "
            "hash's parameters_to_host ran everything); it is there for a run that stops with work queued")
EXPLAINED = {
    # The engine's wait and the trainer's synchronize after the step do the same work: each hides the other.
    "zero2.cu wait_for_all_gathers record": (
        ["train_bert_mini.cu train_step synchronize_all"],
        "the event the next wait stands for: see the wait below"),
    "zero2.cu wait_for_all_gathers wait": (
        ["train_bert_mini.cu train_step synchronize_all"],
        "holds the next forward (compute stream) back until the all-gathers' copies up (comm stream) have "
        "written the parameters; the trainer's synchronize_all after every step runs those copies first. The "
        "engine keeps the wait for its other callers (the doctest suite's models do not synchronize)"),
    "train_bert_mini.cu train_step synchronize_all": (
        ["zero2.cu wait_for_all_gathers wait"],
        "ends the step for its time (trainer/step_observers.cpp: on a GPU the host would time the queueing "
        "alone); it orders nothing the engine's wait for the all-gathers does not"),
    "zero2.cu all_gather_untracked synchronize_all": (
        ["zero2.cu wait_for_all_gathers wait"],
        "after a checkpoint is loaded the host waits for the all-gathers, but reads nothing they write: the "
        "wait for the all-gathers just before it is what holds the next forward back"),
    # The host reads after a later synchronize of the stream its copies are on.
    "runtime/offload.h take_master_from_parameters synchronize": (
        ["zero2.cu local_chunk_sums synchronize"],
        "the host's AdamW reads the master these copies fill only after local_chunk_sums has synchronized "
        "the compute stream they are queued on"),
    "runtime/checkpoint_state.cpp owned_state_to_host synchronize_all": (
        ["runtime/checkpoint_state.cpp owned_state_to_host synchronize"],
        "the host reads the state after the synchronize that follows its copies; the copies are queued on "
        "the compute stream, behind the AdamW that wrote m, v and the master (in fp32 the master is the "
        "parameters, behind the engine's wait for the all-gathers)"),
    "runtime/checkpoint_state.cpp owned_state_from_host synchronize_all": (
        ["runtime/checkpoint_state.cpp owned_state_from_host synchronize"],
        "the host reads the state's copies after the synchronize that follows them, on the same stream as "
        "the work that wrote the state"),
    "runtime/checkpoint_state.cpp owned_state_from_host synchronize #3": (
        ["runtime/checkpoint_state.cpp owned_state_from_host synchronize #2"],
        "the copies up read host vectors that live until the function returns; in mixed precision the "
        "loop's synchronize after the last working copy has run them all, in fp32 all_gather_untracked's "
        "all-gather (it waits for the compute stream) and its synchronize_all do, before the return"),
    "runtime/host_copies.cpp parameters_to_host synchronize_all": (
        ["zero2.cu wait_for_all_gathers wait", "train_bert_mini.cu train_step synchronize_all"],
        "the copy of the parameters is queued on the compute stream, which already waits for the "
        "all-gathers (and the trainer synchronized after the step): nothing else writes them"),
    "runtime/host_copies.cpp working_parameters_to_host synchronize_all": (
        ["runtime/host_copies.cpp working_to_host synchronize"],
        "--dump-batch reads the working parameters before step 1's forward; the copy's own synchronize "
        "(working_to_host) runs it and the build's work before it"),
    "runtime/host_copies.cpp gradients_to_host synchronize_all": (
        ["zero2.cu end_micro_step wait"],
        "the copies of the reduced gradient are queued on the compute stream, which waits for the comm "
        "stream's sums at the micro-step's end, and working_to_host synchronizes it before the host reads"),
    "runtime/allocators.cpp take synchronize": (
        ["zero2.cu allocate synchronize"],
        "an engine buffer's zeroing before the comm stream may touch it: every one is made in build(), "
        "whose synchronize after the weight-decay flags runs the zeroing before any transfer starts"),
    # Nothing to order: the trainer's timing, and the ends of objects.
    "train_bert_mini.cu end_phase synchronize_all": (
        [], "--wall-clock-breakdown's phase boundary: a phase's time includes its device work; orders nothing"),
    "train_bert_mini.cu run synchronize_all": (
        [], "--wall-clock-breakdown's first phase boundary, as above: timing only"),
    "runtime/allocators.cpp give_back synchronize_all": (
        [], "an engine buffer given back: in these runs only at the end, after everything ran; " + TEARDOWN),
    "runtime/compute.cpp ~Compute synchronize_all": ([], TEARDOWN),
    "runtime/transfers.cpp ~BucketExchange synchronize_all": ([], TEARDOWN),
    "train_bert_mini.cu ~Model synchronize_all": ([], TEARDOWN),
    # Not reached by the trainer on sim.
    "runtime/communicator.cpp ~Communicator synchronize_all": (
        [], "--comm nccl only, which --device sim refuses (NCCL is not modelled)"),
    "runtime/host_copies.cpp gradient_buffer_to_host synchronize_all": (
        [], "called by the labs' graders alone (tests/test_labs.cpp), not by the trainer"),
}


class Runner:
    """The trainer's runs, in a scratch directory of their own (removed by close())."""

    def __init__(self, build):
        self.trainer = os.path.join(build, "train_bert_mini")
        self.work = tempfile.mkdtemp(prefix="z2_streams.")
        self.runs = 0
        self.checkpoint = None

    def close(self):
        shutil.rmtree(self.work, ignore_errors=True)

    def new_dir(self):  # a path that does not exist yet: --trace and --save want a new directory
        return tempfile.mkdtemp(dir=self.work) + "/new"

    def flags(self, text):
        if "{checkpoint}" in text and self.checkpoint is None:
            self.checkpoint = self.new_dir()
            self.run(2, CHECKPOINT_FLAGS.replace("{dir}", self.checkpoint), "cpu")
        text = text.replace("{checkpoint}", self.checkpoint or "")
        while "{dir}" in text:
            text = text.replace("{dir}", self.new_dir(), 1)
        return text.split()

    def run(self, ranks, flags, device, env=None):
        """One run: (exit status, output, bits or None, {site: times} from the [sim] lines)."""
        out = os.path.join(self.work, "run.json")
        if os.path.exists(out):
            os.remove(out)
        # A skipped wait can corrupt the heap, and a crash inside malloc can then deadlock in UCX's own
        # SIGSEGV handler (it frees memory: seen once in 157 runs, at exit, in cuBLAS's destructors), so
        # UCX's handler is off. A rank that hangs anyway is killed (-k): mpirun's ranks run in sessions
        # of their own, so the output goes to a file (an orphan cannot hold a pipe open) and any rank
        # left behind is killed by its --json path, which names this run's scratch directory.
        argv = ["timeout", "-k", "5", "60", "mpirun", "-n", str(ranks), self.trainer, *TINY_RUN, *self.flags(flags),
                "--device", device, "--comm", "mpi", "--json", out]
        full_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", UCX_HANDLE_ERRORS="none", **(env or {}))
        log = os.path.join(self.work, "run.log")
        with open(log, "w") as output:
            status = subprocess.run(argv, env=full_env, stdout=output, stderr=subprocess.STDOUT).returncode
        subprocess.run(["pkill", "-KILL", "-f", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        printed = open(log, errors="replace").read()
        self.runs += 1
        bits = None
        if status == 0 and os.path.exists(out):
            d = json.load(open(out))
            bits = d["final_params_hash"] + " " + " ".join(s["loss_bits"] for s in d["steps"])
        counts = {m.group(2): int(m.group(3))
                  for m in re.finditer(r"^\[sim\] (skipped|asked) (\S+) (\d+) times$", printed, re.M)}
        return status, printed, bits, counts


def outcome(status, output, bits, reference):
    """What a run with a site skipped gives: same, changed, race, stopped, crashed or timeout."""
    if status == 0:
        return "same" if bits == reference else "changed"
    if "a race on the simulated device" in output:
        return "race"
    if status in (124, 137):
        return "timeout"
    # A signal: in these runs, a host vector freed before the copy that reads or fills it ran.
    crashed = re.search(r"signal \d+|Segmentation fault|invalid pointer|double free", output)
    return "crashed" if crashed else "stopped"


def first_line_of_interest(output):
    for line in output.split("\n"):
        if any(word in line for word in ("message: a race", "error:", "Caught signal", "invalid pointer",
                                         "Segmentation fault")):
            return line.strip()[:240]
    return ""


def asked_at(asked, site):  # "[sim] asked FILE:LINE" names the site (the build may prefix a directory)
    return asked == site["where"] or asked.endswith("/" + site["where"])


class Mutation:
    """The mutation test's state: the runner, each config's reference bits and reach, the verdicts."""

    def __init__(self, build):
        self.runner = Runner(build)
        self.sites = sites()
        self.keys = {s["key"]: s for s in self.sites}
        self.references, self.reached = [], []
        self.passed = self.failed = 0

    def verdict(self, ok, text):
        print(("PASS " if ok else "FAIL ") + text, flush=True)
        self.passed, self.failed = self.passed + ok, self.failed + (not ok)

    def references_and_reach(self):
        """Each config once on cpu (its reference bits) and once on sim, counting the sites it reaches; the
        sim run is also the config's own check that sim gives cpu's bits."""
        for name, ranks, text in CONFIGS:
            status, output, bits, _ = self.runner.run(ranks, text, "cpu")
            _, _, sim_bits, counts = self.runner.run(ranks, text, "sim", {"Z2_SIM_COUNT": "1"})
            shown = bits.split()[0] if bits else first_line_of_interest(output) or f"exit {status}"
            self.verdict(bits is not None and sim_bits == bits,
                         f"config '{name}': --device sim gives --device cpu's bits ({shown})")
            self.references.append(bits)
            self.reached.append(counts)
        unknown = sorted({w for counts in self.reached for w in counts
                          if not any(asked_at(w, s) for s in self.sites)})
        self.verdict(not unknown, f"the configs reach only sites the sources name ({len(self.sites)} sites)"
                     + (f"; not found there: {unknown}" if unknown else ""))
        stale = [k for k in EXPLAINED if k not in self.keys]
        stale += [m for maskers, _ in EXPLAINED.values() for m in maskers if m not in self.keys]
        self.verdict(not stale, "every site EXPLAINED names is in the sources" + (f"; not: {stale}" if stale else ""))

    def skip(self, k, where):
        """Config k on sim with the sites `where` (FILE:LINE[,FILE:LINE]) skipped: (outcome, its message)."""
        name, ranks, text = CONFIGS[k]
        status, output, bits, _ = self.runner.run(ranks, text, "sim", {"Z2_SIM_SKIP": where})
        return outcome(status, output, bits, self.references[k]), first_line_of_interest(output)

    def site_row(self, site):
        """Skip the site on each config that reaches it, until one shows it; then judge the row."""
        configs = [k for k, counts in enumerate(self.reached)
                   if any(asked_at(w, site) and n > 0 for w, n in counts.items())]
        explained = EXPLAINED.get(site["key"])
        row = {**site, "reached_by": len(configs), "result": "unreached", "by": "", "detail": "",
               "masked_by": [], "masked_result": "", "why": explained[1] if explained else ""}
        for k in configs:
            row["result"], row["detail"] = self.skip(k, site["where"])
            row["by"] = CONFIGS[k][0]
            if row["result"] != "same":
                break
        label = f"{site['where']} ({site['function']}: {site['call']})"
        if row["result"] not in ("same", "unreached"):
            self.verdict(explained is None, f"{label}: skipped, {row['result']} ({row['by']})"
                         + (f": {row['detail']}" if row["detail"] else "")
                         + (": but EXPLAINED says it changes nothing; take it out there" if explained else ""))
        elif explained is None:
            self.verdict(False, f"{label}: {'changes nothing in' if configs else 'reached by none of'} the "
                         f"{len(configs) or len(CONFIGS)} configs: explain it in EXPLAINED, or reach it")
        elif row["result"] == "same" and explained[0]:
            # What hides it must be what the explanation names: skipped together, the run is caught.
            row["masked_by"] = [self.keys[m]["where"] for m in explained[0] if m in self.keys]
            row["masked_result"], _ = self.skip(configs[0], ",".join([site["where"], *row["masked_by"]]))
            self.verdict(row["masked_result"] != "same",
                         f"{label}: changes nothing alone in {len(configs)} config(s); skipped with "
                         f"{', '.join(row['masked_by'])}, which order the same work later: {row['masked_result']}")
        else:
            how = f"changes nothing in {len(configs)} config(s)" if configs else "unreached"
            self.verdict(True, f"{label}: {how}, explained: {explained[1][:120]}")
        return row


def mutation(build, table_path=None):
    test = Mutation(build)
    try:
        test.references_and_reach()
        rows = [test.site_row(site) for site in test.sites]
        print(f"    {len(test.sites)} sites, {test.runner.runs} runs")
    finally:
        test.runner.close()
    if table_path:
        json.dump(rows, open(table_path, "w"), indent=1)
    print(f"{test.passed} passed, {test.failed} failed")


RESULT_WORDS = {"changed": "other bits", "race": "a race report", "stopped": "the run stops (an error)",
                "crashed": "the run crashes", "timeout": "the run hangs (timeout)", "same": "nothing",
                "unreached": "not reached"}


def table(rows_path):
    """The mutation table for notes/15 (markdown), from a mutation run's rows."""
    rows = json.load(open(rows_path))
    caught = [r for r in rows if r["result"] not in ("same", "unreached")]
    hidden = [r for r in rows if r["result"] == "same" and r["masked_by"]]
    nothing = [r for r in rows if r["result"] == "same" and not r["masked_by"]]
    unreached = [r for r in rows if r["result"] == "unreached"]
    by = {k: sum(r["result"] == k for r in caught) for k in ("changed", "race", "stopped", "crashed", "timeout")}
    print(f"Measured by `make notes` (`python3 tests/cli/streams.py mutation BUILD`, what `tests/cli/streams.sh` "
          f"runs): {len(rows)} sites found in the sources, each skipped on the configs that reach it. "
          f"**{len(caught)} caught** (other bits {by['changed']}, a race report {by['race']}, the run stops with "
          f"an error {by['stopped']}, it crashes {by['crashed']}); **{len(hidden)} hidden** by a later wait that "
          f"does the same work (skipped together: caught); **{len(nothing)} with nothing to order** in these "
          f"runs; **{len(unreached)} unreached**. The last three are streams.py's EXPLAINED list, each with why.")
    print()
    print("| site | function | skipped, the run gives | first config that shows it / why it changes nothing |")
    print("|---|---|---|---|")
    for r in caught:
        print(f"| {r['where']} | `{r['function']}` {r['kind']} | {RESULT_WORDS[r['result']]} | {r['by']} |")
    for r in hidden:
        print(f"| {r['where']} | `{r['function']}` {r['kind']} | nothing; with {', '.join(r['masked_by'])}: "
              f"{RESULT_WORDS[r['masked_result']]} | {r['why']} |")
    for r in nothing + unreached:
        print(f"| {r['where']} | `{r['function']}` {r['kind']} | {RESULT_WORDS[r['result']]} | {r['why']} |")


def replace(path, *pairs):
    text = open(path).read()
    for old, new in zip(pairs[::2], pairs[1::2]):
        if text.count(old) != 1:
            sys.exit(f"{path}: {old!r} occurs {text.count(old)} times, not once")
        text = text.replace(old, new)
    open(path, "w").write(text)


if __name__ == "__main__":
    if sys.argv[1] == "sites":
        print_sites()
    else:
        globals()[sys.argv[1]](*sys.argv[2:])
