"""tests/cli/metrics.py — --metrics files and --eval-every's held-out losses against the runs' --json summaries
(tests/cli/metrics.sh)."""
import json
import sys


def lines(metrics_path, run_path):
    """Lines at steps 1, 10, 20, 30; loss_mean the mean of the --json losses since the last line; elapsed rises,
    the ETA ends at 0."""
    lines = [json.loads(line) for line in open(metrics_path)]
    run = json.load(open(run_path))
    loss = {s["step"]: s["loss"] for s in run["steps"]}
    problems = []
    if [line["step"] for line in lines] != [1, 10, 20, 30]:
        problems.append(f"steps {[line['step'] for line in lines]}")
    previous = 0
    for line in lines:
        mean = sum(loss[t] for t in range(previous + 1, line["step"] + 1)) / (line["step"] - previous)
        if abs(line["loss_mean"] - mean) > 1e-9 * abs(mean) or line["losses_in_mean"] != line["step"] - previous:
            problems.append(f"step {line['step']}: loss_mean {line['loss_mean']} != {mean}")
        if line["loss"] != loss[line["step"]]:
            problems.append(f"step {line['step']}: loss")
        previous = line["step"]
    if any(b["elapsed_s"] < a["elapsed_s"] for a, b in zip(lines, lines[1:])):
        problems.append("elapsed goes back")
    if lines and lines[-1]["eta_s"] != 0:
        problems.append("ETA at the last step is not 0")
    print("ok" if not problems else "; ".join(problems[:3]))


def whole_lines(path):
    """The number of lines of a killed run's --metrics; fails on a partial last line or one that is not JSON."""
    lines = open(path).read().split("\n")
    assert lines[-1] == "", "a partial last line"
    [json.loads(line) for line in lines[:-1]]
    print(len(lines) - 1)


def evaluations(eval_1, eval_2, eval_4, eval_rare, metrics_path):
    """The held-out loss: the same bits at every (N, A, stage), every 3 or every 6 trains the same, in --metrics."""
    runs = [json.load(open(p)) for p in (eval_1, eval_2, eval_4, eval_rare)]
    metrics = [json.loads(line) for line in open(metrics_path)]
    problems = []
    evals = [[(e["step"], e["loss_bits"]) for e in r["eval"]] for r in runs[:3]]
    if [s for s, _ in evals[0]] != [3, 6]:
        problems.append(f"evaluated at {evals[0]}")
    if any(e != evals[0] for e in evals):
        problems.append(f"eval bits differ: {evals}")
    if len({r["final_params_hash"] for r in runs}) != 1:
        problems.append("--eval-every 3 and 6 train differently")
    if runs[3]["eval"] != runs[0]["eval"][1:]:
        problems.append("the step-6 evaluation differs between --eval-every 3 and 6")
    if [m["eval_loss"] for m in metrics if "eval_loss" in m] != [runs[3]["eval"][0]["loss"]]:
        problems.append("metrics lack the eval line")
    print("ok" if not problems else "; ".join(problems))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
