"""tests/test_hypotheses.py: tests/check_trace.py's naming by replayed hypotheses (tests/peers/adamw_replay.py's
HYPOTHESES) on synthetic peers, in fp32 and bf16.

    /usr/bin/python3 tests/test_hypotheses.py REF_FP32 REF_BF16

REF_FP32 and REF_BF16 are zero2's traces with every step kept (tests/peers/reference_trace.sh TRAINER DIR 2
--trace-params-every 1 [--precision bf16]). A synthetic peer is zero2's trace whose parameters after each step
are replaced by a hypothesis's step, replayed forward from the peer's own parameters before it with the trace's
recorded gradients: the replay's own arithmetic, so this tests the naming (which hypotheses fit, what the
steps after and before tell, that no pattern pre-empts a replay, the "named:" line), not the arithmetic, which
make check-peer PEER=torch tests against torch's. Options of a synthetic peer:

  start16   the peer's fp32 master starts from the bf16-rounded initial weights (DeepSpeed's does)
  keep      the steps whose parameters the peer keeps (all by default)

Prints one line per case, the measured share of the tolerance for the correct peers, and "N passed, M failed".
"""
import io
import json
import os
import shutil
import sys
import tempfile
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))

import adamw_replay  # noqa: E402
import check_trace  # noqa: E402
from trace_diagnosis import bfloat16  # noqa: E402
from trace_files import read_safetensors, write_safetensors  # noqa: E402


def synthetic_peer(ref, out, changes, start16=False, keep=None):
    """zero2's trace `ref` copied to `out`, its parameters after each step the hypothesis `changes`'s step."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(ref, out)
    trace = json.load(open(os.path.join(ref, "trace.json")))
    steps = trace["steps"]
    flat = adamw_replay.Flat(trace["layout"], set(trace["optimizer"]["no_weight_decay"]), trace["run"]["world_size"])
    rates = [s["lr"] for s in steps]
    replay = adamw_replay.Replay(flat, trace["optimizer"], rates, changes, None, trace["run"]["accumulation_steps"])
    params = flat.flat(read_safetensors(os.path.join(ref, "initial", "model.safetensors")))
    if start16:
        params = bfloat16(params)
    for t in range(1, len(steps) + 1):
        gradient = flat.flat(read_safetensors(os.path.join(ref, f"step_{t}", "gradients.safetensors")))
        params = replay.step(t, params, gradient, steps[t - 1]["grad_norm"])
        shapes = {p["name"]: p["shape"] for p in trace["layout"]["parameters"]}
        write_safetensors(os.path.join(out, f"step_{t}", "model.safetensors"),
                          {n: v.reshape(shapes[n]).copy() for n, v in flat.tensors(params).items()})
    if keep is not None:
        theirs = json.load(open(os.path.join(out, "trace.json")))
        theirs["parameter_steps"] = [e for e in theirs["parameter_steps"] if e["step"] in keep]
        for t in range(1, len(steps) + 1):
            if t not in keep:
                shutil.rmtree(os.path.join(out, f"step_{t}"))
        json.dump(theirs, open(os.path.join(out, "trace.json"), "w"))


def check(ref, theirs):
    output = io.StringIO()
    with redirect_stdout(output):
        status = check_trace.main(["check_trace.py", ref, theirs])
    return status, output.getvalue()


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    refs = {"fp32": argv[1], "bf16": argv[2]}
    work = tempfile.mkdtemp(prefix="z2_hypotheses.")
    passed = failed = 0
    # (precision, label, changes, options, the line expected after "diagnosis:" (exact, or its beginning))
    cases = [
        ("fp32", "correct", {}, {}, None),
        ("bf16", "correct", {}, {}, None),
        ("bf16", "correct, master from bf16 weights", {}, dict(start16=True), None),
        ("fp32", "lr x 2", dict(lr_factor=2.0), {}, "named: schedule.lr-scaled"),
        ("fp32", "lr x 2, steps 1, 5, .. kept", dict(lr_factor=2.0), dict(keep={1, 5, 10, 15, 20}),
         "fits: schedule.lr-of-step-after, schedule.lr-scaled (not told apart:"),
        ("fp32", "lr x 3", dict(lr_factor=3.0), {}, "named: schedule.lr-scaled"),
        ("fp32", "no decay", dict(decay="none"), {}, "named: adamw.no-decay"),
        ("fp32", "decay x 5", dict(decay_factor=5.0), {}, "named: adamw.decay-scaled"),
        ("fp32", "eps 1e-6", dict(eps_value=1e-6), {}, "named: adamw.eps-other"),
        ("fp32", "counter micro-steps (A = 1: the true step)", dict(counter="micro_steps"), {}, None),
        ("fp32", "momentum undamped", dict(momentum="undamped"), {}, "named: adamw.momentum-undamped"),
        ("fp32", "v of |g|", dict(v_of="abs"), {}, "named: adamw.v-of-abs"),
        ("fp32", "no embeddings decay", dict(decay_set="no_embeddings"), {}, "named: adamw.no-decay-on-embeddings"),
        ("fp32", "clip per tensor", dict(clipping="per_tensor"), {}, "named: clipping.per-tensor"),
        # Clipped at every step of this run (its norms stay above 0.5), the gradient is scaled by clip / norm,
        # which AdamW's step sees only through eps: another eps fits every step too, and both are said.
        ("fp32", "clip threshold x 0.5", dict(clip_factor=0.5), {},
         "fits: adamw.eps-other, clipping.threshold-scaled (not told apart:"),
        # A threshold of 5 never binds in this run (its norms are 2 to 3.6): no clipping, which it then is.
        ("fp32", "clip threshold x 5", dict(clip_factor=5.0), {}, "named: clipping.none"),
        ("fp32", "state reset, counter 1", dict(reset=True, reset_counter=True), {}, "named: state.reset-each-step"),
        ("fp32", "no update", dict(no_update=True), {}, "named: state.update-not-applied"),
        ("fp32", "warmup from zero", dict(warmup_from_zero=True), {}, "named: schedule.warmup-from-zero"),
        ("bf16", "lr x 2", dict(lr_factor=2.0), dict(start16=True), "named: schedule.lr-scaled"),
        ("bf16", "eps inside", dict(eps="inside"), dict(start16=True), "named: adamw.eps-inside"),
        ("bf16", "no decay", dict(decay="none"), {}, None),  # below bf16's tolerance: passes
        ("bf16", "decay without lr", dict(decay="without_lr"), dict(start16=True),
         "named: adamw.decay-without-lr"),
        ("bf16", "state reset", dict(reset=True), {}, "named: state.reset-each-step"),
        ("bf16", "no bias correction of v", dict(correct_v=False), {}, "named: adamw.no-bias-correction-v"),
    ]
    try:
        for precision, label, changes, options, expect in cases:
            theirs = os.path.join(work, "theirs")
            synthetic_peer(refs[precision], theirs, changes, **options)
            status, output = check(refs[precision], theirs)
            lines = output.splitlines()
            after = next((lines[i + 1] for i, line in enumerate(lines) if line.startswith("diagnosis:")), "")
            margin = next((line for line in lines if line.startswith("margin:")), "")
            closest = next((line for line in lines if line.startswith("PASS:")), "")
            if expect is None:
                good = status == 0
                said = closest[closest.find("the closest call"):] if good else f"exit {status}: {after} {margin}"
            else:
                good = status == 1 and after.startswith(expect)
                said = f"{margin[len('margin: the difference is '):]}; {after}" if status == 1 else f"exit {status}"
            print(f"{'PASS' if good else 'FAIL'} {precision} {label}: {said[:300]}")
            if not good:
                print("\n".join("    " + line[:400] for line in lines[-6:]))
            passed, failed = passed + good, failed + (not good)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
