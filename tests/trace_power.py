"""tests/trace_power.py: what a PASS of tests/check_trace.py could not have seen (notes/12, "The power of a
PASS"): the smallest relative error in the rate, the weight decay, the gradient scale and the clipping threshold
that the walk's allowances would have failed. Moved out of the checker unchanged; `pair` is its Pair.
"""
import math
import os
import sys

import numpy as np

from trace_tolerances import is_finite_number

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import adamw_replay  # noqa: E402



class Power:
    """The smallest mistakes of each kind that the walk's allowances would have failed, as relative errors:
    a rate off by a factor (1 + e) moves every parameter's total update by e (AdamW's update is linear in the
    rate), so e = the median allowance / the median |p_s - p_0| of a tensor; a weight decay off by (1 + e)
    moves a decayed tensor by e wd (the rates summed) |p|; a gradient scaled by (1 + e) is e of every checkable
    tensor's gradient and of the norm; a clipping threshold off by (1 + e) scales the gradient of each clipped
    step, which AdamW's normalisation sees only through the steps' relative sizes, so it is replayed (every
    step's gradient kept) or said to be unknown. Each is the smallest over the steps and tensors compared."""

    KINDS = ("lr", "weight_decay", "grad_scale", "clip")

    def __init__(self, pair):
        self.pair, self.best = pair, {kind: None for kind in self.KINDS}  # kind -> (e, where)

    def smallest(self, kind, e, where):
        if math.isfinite(e) and e > 0 and (self.best[kind] is None or e < self.best[kind][0]):
            self.best[kind] = (e, where)

    def parameters(self, step, name, allowance, values, initial, lr_sum):
        moved = float(np.median(np.abs(values - initial)))
        if moved > 0:
            self.smallest("lr", allowance / moved, f"step {step}, {name}")
        wd = self.pair.ref.optimizer["weight_decay"]
        size = float(np.median(np.abs(values)))
        if wd > 0 and name not in self.pair.no_decay and size > 0:
            self.smallest("weight_decay", allowance / (wd * lr_sum * size), f"step {step}, {name}")

    def clip(self):
        """(e, where) for the clipping threshold; ("unbounded", why) where no threshold error could show, (None,
        why) where the trace cannot say."""
        ref = self.pair.ref
        clip = ref.optimizer["clip"]
        if not clip > 0:
            return None, "the run does not clip"
        clipped = [r["step"] for r in ref.steps if is_finite_number(r.get("grad_norm")) and r["grad_norm"] > clip]
        if not clipped:
            # A threshold off by e changes nothing until a norm crosses it: the nearest a norm came.
            nearest = min((clip - r["grad_norm"]) / clip for r in ref.steps if is_finite_number(r.get("grad_norm")))
            return nearest, "no step was clipped: the nearest norm to the threshold"
        if len(clipped) == len(ref.steps):
            return "unbounded", ("every step was clipped, and AdamW's update does not change when every gradient "
                                 "is scaled alike: a threshold off by any factor moves nothing but eps's share")
        return clip_replay(self.pair, clipped)

    def report(self):
        """(the power line's words, the JSON's dict)."""
        values, words = {}, []
        names = {"lr": "a rate", "weight_decay": "a weight decay", "grad_scale": "a gradient scale",
                 "clip": "a clipping threshold"}
        for kind in self.KINDS:
            if kind == "clip":
                e, where = self.clip()
            else:
                e, where = self.best[kind] if self.best[kind] else (None, "nothing compared sees it")
                if kind == "weight_decay" and not self.pair.ref.optimizer["weight_decay"] > 0:
                    where = "the run has no weight decay"
            # JSON: the relative error below which this kind cannot be seen; "unbounded" where no size of it
            # could (the reason says why); null where the trace cannot say.
            values[kind] = e if e in (None, "unbounded") else float(f"{e:.3g}")
            words.append(f"{names[kind]} off by less than {e:.2g} ({where})" if isinstance(e, float) else
                         f"{names[kind]}: not bounded ({where})" if e == "unbounded" else
                         f"{names[kind]}: not known ({where})")
        return "; ".join(words), values


def clip_replay(pair, clipped):
    """The clipping threshold's power by replay: zero2's AdamW over zero2's gradients, once as it ran and once
    with every clipped step's gradient scaled by 1.01 (a threshold 1% higher), from the initial weights to the
    last step whose every gradient is kept; the parameters' median change per tensor against the allowance
    there, scaled linearly to the e that would reach it."""
    ref = pair.ref
    last = 0
    while last + 1 in ref.parameter_steps and ref.parameter_steps[last + 1]:
        last += 1
    if not any(t <= last for t in clipped) or last == 0 or last not in ref.parameter_steps:
        return None, "the trace does not keep every step's gradient up to a clipped step (--trace-params-every 1)"
    flat = adamw_replay.Flat(pair.layout, pair.no_decay, pair.N)
    rates = [r["lr"] for r in ref.steps]
    runs = [adamw_replay.Replay(flat, ref.optimizer, rates, {}), adamw_replay.Replay(flat, ref.optimizer, rates, {})]
    params = [flat.flat(pair.tensors("ref", "parameters", 0))] * 2
    for t in range(1, last + 1):
        gradient = flat.flat(ref.gradients(t))
        norm = ref.steps[t - 1]["grad_norm"]
        scaled = gradient * np.float32(1.01) if t in clipped else gradient
        # The same norm: the coefficient stays, so the clipped step applies 1.01 x the gradient it applied.
        params = [runs[0].step(t, params[0], gradient, norm), runs[1].step(t, params[1], scaled, norm)]
    lr_sum = sum(rates[:last])
    best = None
    for name, values in flat.tensors(np.abs(params[1].astype(np.float64) - params[0])).items():
        change = float(np.median(values))
        if name in pair.noise or change <= 0:
            continue
        e = 0.01 * pair.allowances.parameter_median(name, lr_sum) / change
        best = e if best is None or e < best else best
    return (best, f"replayed to step {last}") if best is not None else (None, "the replay moved nothing")
