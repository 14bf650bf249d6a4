"""tests/peers/adamw_replay.py: AdamW's step in zero2's fp32 arithmetic, and a catalogue of the mistakes an
AdamW is commonly written with, each as the same step changed in one place. tests/check_trace.py replays a
failing step with each (notes/12, "What the checker recognises") and names the one that reproduces theirs.

The true step is zero2's adamw_update (zero2.h) element for element: the scalars computed in double and
rounded to float once (Engine::RankState::adamw_constants in zero2.cu, beta^t by repeated squaring as
runtime/math.h's power_double), the clipping coefficient (float) clip / (norm + 1e-6f) capped at 1, then in
float32: g *= coefficient; p *= 1 - lr wd (decayed tensors); m lerped towards g; v = v b2 + ((1 - b2) g) g;
p += (-lr / (1 - b1^t) m) / (sqrt(v) / sqrt(1 - b2^t) + eps). A variant changes one of those and nothing
else, so a replay of the right variant from the same parameters, state and gradient differs from theirs by
the rounding of one update's arithmetic done in another order.

Numpy only, on flat float32 arrays in zero2's padded layout (padding stays 0: every variant maps
p = g = m = v = 0 to 0).
"""
import math

import numpy as np

F32 = np.float32


def power_double(base, exponent):
    """base^exponent by repeated squaring in double: runtime/math.h's power_double, the same bits."""
    result = 1.0
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


def clip_coefficient(clip, norm):
    """zero2's (and clip_grad_norm_'s) coefficient in float: clip / (norm + 1e-6), at most 1; 1 without clip."""
    if clip <= 0:
        return F32(1.0)
    return min(F32(clip) / (F32(norm) + F32(1e-6)), F32(1.0))


# The catalogue. Each variant is the true step with some of these changed:
#   decay    "decoupled" (AdamW: p (1 - lr wd)) or "l2" (wd p added to the gradient Adam normalises)
#   eps      "outside" sqrt(v_hat) + eps; "inside" sqrt(v_hat + eps); "inside_uncorrected" sqrt(v + eps) / sqrt(bc2)
#   correct_m, correct_v   the bias corrections 1 / (1 - b1^t) of m and 1 / (1 - b2^t) of v
#   swap_betas             b1 used for v and b2 for m
#   lr_shift               the rate of step s + lr_shift used for step s's update
#   clipping "global" (the whole gradient's norm), "none", "local" (each rank's own shard's norm)
#   fixed_betas            the optimizer's betas in every update, where the trace's scheduler set them per
#                          update (steps[].betas: DeepSpeed's OneCycle); applies only to such a trace
# `words` is what the checker says when the variant reproduces theirs and the true step does not; each
# variant's words are distinct, so tests/peers/check_peer.sh can find them in the diagnosis.
TRUE = dict(decay="decoupled", eps="outside", correct_m=True, correct_v=True, swap_betas=False, lr_shift=0,
            clipping="global", fixed_betas=False)

CATALOGUE = [
    ("L2-style weight decay", dict(decay="l2"),
     "wd x p added to the gradient before Adam normalises it (torch.optim.Adam's weight_decay, L2 regularisation), "
     "where AdamW decays the parameter itself, p <- p (1 - lr wd), outside the normalised step"),
    ("eps inside the square root", dict(eps="inside"),
     "the denominator is sqrt(v / (1 - beta2^t) + eps), where AdamW's is sqrt(v / (1 - beta2^t)) + eps"),
    ("eps inside the square root, before the bias correction", dict(eps="inside_uncorrected"),
     "the denominator is sqrt(v + eps) / sqrt(1 - beta2^t), where AdamW's is sqrt(v) / sqrt(1 - beta2^t) + eps"),
    ("AdamW without the bias correction of m", dict(correct_m=False),
     "the step is -lr m / denominator, where AdamW's is -lr / (1 - beta1^t) m / denominator (v's correction is "
     "there)"),
    ("AdamW without the bias correction of v", dict(correct_v=False),
     "the denominator is sqrt(v) + eps, where AdamW's is sqrt(v) / sqrt(1 - beta2^t) + eps (m's correction is "
     "there)"),
    ("AdamW without its bias corrections", dict(correct_m=False, correct_v=False),
     "neither m / (1 - beta1^t) nor v / (1 - beta2^t)"),
    ("beta1 and beta2 swapped", dict(swap_betas=True),
     "m is averaged with the trace's beta2 and v with its beta1 (betas passed in the wrong order)"),
    ("the rate of the step before", dict(lr_shift=-1),
     "step s updates with the rate zero2 used for step s - 1: the schedule lags one step (the scheduler stepped "
     "after the rate was read, or counts from 0 where the trace counts from 1)"),
    ("the rate of the step after", dict(lr_shift=+1),
     "step s updates with the rate zero2 used for step s + 1: the schedule runs one step ahead (the scheduler "
     "stepped before the optimizer)"),
    ("no gradient clipping", dict(clipping="none"),
     "the update used the gradient as reduced, where the trace clips it to the norm optimizer.clip"),
    ("clipping by each rank's own shard's norm", dict(clipping="local"),
     "each rank scaled its shard by clip / (its own shard's norm + 1e-6), where the coefficient comes from the "
     "whole gradient's norm (sum every rank's squares before the square root)"),
    ("the optimizer's betas, not the scheduler's", dict(fixed_betas=True),
     "every update used optimizer.betas, where the trace's scheduler set each update's (steps[].betas: "
     "DeepSpeed's OneCycle cycles beta1 and sets beta2 to 0.99); set the optimizer's betas every step"),
]


class Flat:
    """zero2's padded flat layout (a trace's `layout`): named tensors to one flat float32 array and back, which
    rank's shard each element lies in, and which elements AdamW decays."""

    def __init__(self, layout, no_decay, world_size):
        self.layout, self.size = layout, layout["psi_padded"]
        self.params = layout["parameters"]
        self.decay = np.zeros(self.size, dtype=bool)
        for p in self.params:
            self.decay[p["offset"]:p["offset"] + p["numel"]] = p["name"] not in no_decay
        self.rank = np.zeros(self.size, dtype=np.int64)  # padding's rank is its bucket's, as in zero2
        for b in layout["buckets"]:
            for r in range(world_size):
                begin = b["offset"] + r * b["shard_length"]
                self.rank[begin:begin + b["shard_length"]] = r
        self.world_size = world_size

    def flat(self, tensors):
        out = np.zeros(self.size, dtype=F32)
        for p in self.params:
            out[p["offset"]:p["offset"] + p["numel"]] = np.asarray(tensors[p["name"]], dtype=F32).reshape(-1)
        return out

    def tensors(self, flat):
        return {p["name"]: flat[p["offset"]:p["offset"] + p["numel"]] for p in self.params}


class Replay:
    """One variant's AdamW, its state (m, v) carried from step 1 through every step fed to it."""

    def __init__(self, flat, optimizer, rates, changes, betas=None):
        # betas: each update's (beta1, beta2) where a scheduler sets them (DeepSpeed's OneCycle: the trace's
        # steps[].betas), else None and the optimizer's throughout
        self.flat, self.settings, self.rates, self.betas = flat, optimizer, rates, betas
        self.variant = dict(TRUE, **changes)
        self.m = np.zeros(flat.size, dtype=F32)
        self.v = np.zeros(flat.size, dtype=F32)

    def applies(self, step):
        """Whether the variant differs from the true step's formula here (its neighbouring rate exists)."""
        return 1 <= step + self.variant["lr_shift"] <= len(self.rates) and \
            (self.betas is not None or not self.variant["fixed_betas"])

    def step(self, t, params, grad, norm):
        """Update t (1-based) from `params` and the gradient before clipping `grad` (flat float32), `norm` the
        gradient's norm its producer recorded; advances m and v and returns the parameters after it."""
        variant, o = self.variant, self.settings
        betas = self.betas[t - 1] if self.betas and not variant["fixed_betas"] else o["betas"]
        beta1, beta2 = betas[::-1] if variant["swap_betas"] else betas
        lr = self.rates[t - 1 + variant["lr_shift"]]
        g = grad.copy()
        if variant["clipping"] == "global":
            coefficient = clip_coefficient(o["clip"], norm)
            if coefficient != 1:
                g *= coefficient
        elif variant["clipping"] == "local" and o["clip"] > 0:
            for r in range(self.flat.world_size):
                own = self.flat.rank == r
                shard_norm = math.sqrt(float(np.dot(grad[own].astype(np.float64), grad[own].astype(np.float64))))
                coefficient = clip_coefficient(o["clip"], shard_norm)
                if coefficient != 1:
                    g[own] *= coefficient
        p = params.copy()
        decay = self.flat.decay
        if o["weight_decay"]:
            if variant["decay"] == "decoupled":
                p[decay] *= F32(1.0 - lr * o["weight_decay"])
            else:
                g[decay] += F32(o["weight_decay"]) * params[decay]
        w = F32(1.0 - beta1)  # m.lerp_(g, w), in lerp's two branches as zero2.h's adamw_update
        self.m = self.m + w * (g - self.m) if w < 0.5 else g - (g - self.m) * (F32(1.0) - w)
        self.v = self.v * F32(beta2) + (F32(1.0 - beta2) * g) * g
        corrected = o["bias_correction"]
        bc1 = 1.0 - power_double(beta1, t) if corrected and variant["correct_m"] else 1.0
        bc2 = 1.0 - power_double(beta2, t) if corrected and variant["correct_v"] else 1.0
        if variant["eps"] == "outside":
            denominator = np.sqrt(self.v) / F32(math.sqrt(bc2)) + F32(o["eps"])
        elif variant["eps"] == "inside":
            denominator = np.sqrt(self.v / F32(bc2) + F32(o["eps"]))
        else:
            denominator = np.sqrt(self.v + F32(o["eps"])) / F32(math.sqrt(bc2))
        # Padding (m = v = 0) with eps inside gives 0 / sqrt(eps) = 0: no 0 / 0 in any variant but eps = 0's,
        # where zero2 too divides 0 by 0 on padding; those elements are never compared.
        with np.errstate(invalid="ignore", divide="ignore"):
            return p + (F32(-lr / bc1) * self.m) / denominator
