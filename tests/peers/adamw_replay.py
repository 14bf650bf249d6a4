"""tests/peers/adamw_replay.py: AdamW's step in zero2's fp32 arithmetic, and a hypothesis for each mistake of
tests/bug_taxonomy.py that a replay can recompute (its classes with how == "replay"), keyed by the class id
(HYPOTHESES), each the same step changed in one place. tests/check_trace.py replays a failing step with every
hypothesis (notes/12, "Replaying the failing step") and names a class only where one alone reproduces theirs.

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


# The hypotheses. Each is the true step with some of these changed:
#   decay        "decoupled" (AdamW: p (1 - lr wd)), "l2" (wd p added to the gradient Adam normalises), "none",
#                "without_lr" (p (1 - wd))
#   decay_set    the tensors decayed: "trace" (all but optimizer.no_weight_decay), "everything", "no_embeddings"
#                (the trace's, less the embeddings)
#   decay_factor weight decay x this (fitted: "decay")
#   eps          "outside" sqrt(v_hat) + eps; "inside" sqrt(v_hat + eps); "inside_uncorrected" sqrt(v + eps) / sqrt(bc2)
#   eps_value    another eps than the trace's (fitted: "eps"); None: the trace's
#   correct_m, correct_v   the bias corrections 1 / (1 - b1^t) of m and 1 / (1 - b2^t) of v
#   swap_betas   b1 used for v and b2 for m
#   momentum     "lerp" (m += (1 - b1)(g - m)) or "undamped" (m = b1 m + g)
#   v_of         "square" (v averages g^2) or "abs" (v averages |g|; the denominator as AdamW's)
#   reset        m and v zeroed before every update; reset_counter: the bias corrections' t with them (t = 1)
#   counter      the t of the bias corrections: "updates" (t), "ahead" (t + 1), "micro_steps" (t A)
#   lr_shift     the rate of step s + lr_shift used for step s's update
#   warmup_from_zero   the rate of step s - 1 for step s, and 0 for step 1 (a warmup counted from 0)
#   lr_factor    every rate x this (fitted: "lr")
#   no_update    the parameters not moved at all (the update never reached the weights)
#   clipping     "global" (the whole gradient's norm), "none", "local" (each rank's own shard's norm),
#                "per_group" (the decayed and the not-decayed tensors each by its own norm), "per_tensor"
#   clip_factor  the clipping threshold x this (fitted: "clip")
#   fixed_betas  the optimizer's betas in every update, where the trace's scheduler set them per update
#                (steps[].betas: DeepSpeed's OneCycle); applies only to such a trace
# A fitted factor (`fit`) is solved for at the failing step (tests/trace_diagnosis.py, fit_factor) and then held
# for the steps after it. `generalises`: the hypotheses that are this family at one value of its factor (no
# decay is decay x 0): where one of them fits too, it is named, not the family.
TRUE = dict(decay="decoupled", decay_set="trace", decay_factor=1.0, eps="outside", eps_value=None, correct_m=True,
            correct_v=True, swap_betas=False, momentum="lerp", v_of="square", reset=False, reset_counter=False,
            counter="updates",
            lr_shift=0, warmup_from_zero=False, lr_factor=1.0, no_update=False, clipping="global",
            clip_factor=1.0, fixed_betas=False)


def _h(changes, name, words, fit=None, generalises=()):
    """changes: a dict, or a list of them where the mistake is written in more than one way (each replayed, the
    nearest to theirs counted)."""
    return dict(changes=changes if isinstance(changes, list) else [changes], name=name, words=words, fit=fit,
                generalises=generalises)


# `name` and `words` are what the checker says when the hypothesis reproduces theirs and the true step does
# not; each name is distinct (tests/peers/check_peer.sh finds them in the diagnosis).
HYPOTHESES = {
    "adamw.l2-decay": _h(dict(decay="l2"), "L2-style weight decay",
        "wd x p added to the gradient before Adam normalises it (torch.optim.Adam's weight_decay, L2 "
        "regularisation), where AdamW decays the parameter itself, p <- p (1 - lr wd), outside the normalised step"),
    "adamw.no-decay": _h(dict(decay="none"), "no weight decay",
        "theirs applied no weight decay: AdamW's p <- p (1 - lr wd) is missing on the decayed tensors (rows no "
        "batch reaches, which only decay moves, stayed where they were)"),
    "adamw.decay-everything": _h(dict(decay_set="everything"), "weight decay on every tensor",
        "weight decay was applied to them: the biases and LayerNorm weights (the trace's "
        "optimizer.no_weight_decay) were decayed too; leave them out of AdamW's decay"),
    "adamw.no-decay-on-embeddings": _h(dict(decay_set="no_embeddings"), "no weight decay on the embeddings",
        "the embeddings were put in the group without weight decay, where the trace decays them"),
    "adamw.decay-without-lr": _h(dict(decay="without_lr"), "weight decay without the rate",
        "p <- p (1 - wd), where AdamW's is p (1 - lr wd): the decay is not multiplied by the learning rate"),
    "adamw.decay-scaled": _h({}, "weight decay scaled",
        "the weight decay is another than optimizer.weight_decay (a factor off: a config key read wrongly, or "
        "wd multiplied where it is given)", fit="decay", generalises=("adamw.no-decay",)),
    "adamw.eps-inside": _h(dict(eps="inside"), "eps inside the square root",
        "the denominator is sqrt(v / (1 - beta2^t) + eps), where AdamW's is sqrt(v / (1 - beta2^t)) + eps"),
    "adamw.eps-inside-uncorrected": _h(dict(eps="inside_uncorrected"),
        "eps inside the square root, before the bias correction",
        "the denominator is sqrt(v + eps) / sqrt(1 - beta2^t), where AdamW's is sqrt(v) / sqrt(1 - beta2^t) + eps"),
    "adamw.eps-other": _h({}, "another eps",
        "AdamW's eps is another than optimizer.eps (the fitted value above)", fit="eps"),
    "adamw.no-bias-correction-m": _h(dict(correct_m=False), "AdamW without the bias correction of m",
        "the step is -lr m / denominator, where AdamW's is -lr / (1 - beta1^t) m / denominator (v's correction is "
        "there)"),
    "adamw.no-bias-correction-v": _h(dict(correct_v=False), "AdamW without the bias correction of v",
        "the denominator is sqrt(v) + eps, where AdamW's is sqrt(v) / sqrt(1 - beta2^t) + eps (m's correction is "
        "there)"),
    "adamw.no-bias-correction": _h(dict(correct_m=False, correct_v=False), "AdamW without its bias corrections",
        "neither m / (1 - beta1^t) nor v / (1 - beta2^t)"),
    "adamw.betas-swapped": _h(dict(swap_betas=True), "beta1 and beta2 swapped",
        "m is averaged with the trace's beta2 and v with its beta1 (betas passed in the wrong order)"),
    "adamw.momentum-undamped": _h(dict(momentum="undamped"), "momentum without (1 - beta1)",
        "m <- beta1 m + g, where AdamW's is beta1 m + (1 - beta1) g (SGD's momentum written into Adam)"),
    "adamw.v-of-abs": _h(dict(v_of="abs"), "v of |g|",
        "v averages |g|, where AdamW's averages g^2"),
    "state.reset-each-step": _h([dict(reset=True, reset_counter=True), dict(reset=True)],
        "the optimizer's state reset every step",
        "m and v start from zero at every update (the optimizer made anew each step, its counter with it, or its "
        "state zeroed with the counter kept)"),
    "state.counter-ahead": _h(dict(counter="ahead"), "the step counter one ahead",
        "the bias corrections count t + 1 (the counter incremented before the first update, or from 1 and then "
        "again)"),
    "state.counter-micro-steps": _h(dict(counter="micro_steps"), "the step counter counting micro-steps",
        "the bias corrections count t x A, every micro-step, where AdamW's counts the updates"),
    "state.update-not-applied": _h(dict(no_update=True), "no update",
        "every parameter still holds its value from before this step: the update never reached the weights "
        "(the optimizer stepped a copy, or the all-gather sent the parameters from before the update)"),
    "schedule.lr-of-step-before": _h(dict(lr_shift=-1), "the rate of the step before",
        "step s updates with the rate zero2 used for step s - 1: the schedule lags one step (the scheduler "
        "stepped after the rate was read, or counts from 0 where the trace counts from 1)"),
    "schedule.lr-of-step-after": _h(dict(lr_shift=+1), "the rate of the step after",
        "step s updates with the rate zero2 used for step s + 1: the schedule runs one step ahead (the scheduler "
        "stepped before the optimizer)"),
    "schedule.lr-scaled": _h({}, "the learning rate scaled",
        "every update's rate is a constant factor (the fitted one above) times the recorded one", fit="lr"),
    "schedule.warmup-from-zero": _h(dict(warmup_from_zero=True), "the warmup counted from 0",
        "the first update at rate 0 and every later one at the rate of the step before (the warmup counts "
        "steps from 0 where the trace counts from 1)"),
    "schedule.fixed-betas": _h(dict(fixed_betas=True), "the optimizer's betas, not the scheduler's",
        "every update used optimizer.betas, where the trace's scheduler set each update's (steps[].betas: "
        "DeepSpeed's OneCycle cycles beta1 and sets beta2 to 0.99); set the optimizer's betas every step"),
    "clipping.none": _h(dict(clipping="none"), "no gradient clipping",
        "the update used the gradient as reduced, where the trace clips it to the norm optimizer.clip"),
    "clipping.local-norm": _h(dict(clipping="local"), "clipping by each rank's own shard's norm",
        "each rank scaled its shard by clip / (its own shard's norm + 1e-6), where the coefficient comes from the "
        "whole gradient's norm (sum every rank's squares before the square root)"),
    "clipping.per-group": _h(dict(clipping="per_group"), "clipping each parameter group by its own norm",
        "the decayed and the not-decayed tensors were each clipped by their own group's norm, where the "
        "coefficient comes from the whole gradient's norm"),
    "clipping.per-tensor": _h(dict(clipping="per_tensor"), "clipping each tensor by its own norm",
        "each tensor was clipped by its own norm, where the coefficient comes from the whole gradient's norm"),
    "clipping.threshold-scaled": _h({}, "another clipping threshold",
        "the gradient was clipped to another norm than optimizer.clip (the fitted factor above)", fit="clip",
        generalises=("clipping.none",)),
}


def state_key(variant):
    """What of a variant changes m and v (Replay.advance): variants with one key share one state."""
    l2 = variant["decay"] == "l2"
    return (variant["clipping"], variant["clip_factor"], l2, variant["decay_set"] if l2 else None,
            variant["decay_factor"] if l2 else None, variant["swap_betas"], variant["momentum"], variant["v_of"],
            variant["reset"], variant["fixed_betas"])


class Flat:
    """zero2's padded flat layout (a trace's `layout`): named tensors to one flat float32 array and back, which
    rank's shard each element lies in, and which elements AdamW decays."""

    def __init__(self, layout, no_decay, world_size):
        self.layout, self.size = layout, layout["psi_padded"]
        self.params = layout["parameters"]
        self.decay = np.zeros(self.size, dtype=bool)
        self.real = np.zeros(self.size, dtype=bool)  # every tensor's elements, not the padding
        self.embeddings = np.zeros(self.size, dtype=bool)
        for p in self.params:
            where = slice(p["offset"], p["offset"] + p["numel"])
            self.decay[where] = p["name"] not in no_decay
            self.real[where] = True
            self.embeddings[where] = "embeddings" in p["name"] and "LayerNorm" not in p["name"]
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

    def decayed(self, decay_set):
        if decay_set == "everything":
            return self.real
        if decay_set == "no_embeddings":
            return self.decay & ~self.embeddings
        return self.decay


def norm_of(values):
    return math.sqrt(float(np.dot(values.astype(np.float64), values.astype(np.float64))))


class Replay:
    """One hypothesis's AdamW, its state (m, v) carried from step 1 through every step fed to it: advance()
    takes a step's gradient into the state, update() returns the parameters after the step from those
    before it and the state (so a fitted factor of the update, which leaves the state alone, is solved for
    from one advance)."""

    def __init__(self, flat, optimizer, rates, changes, betas=None, accumulation_steps=1):
        # betas: each update's (beta1, beta2) where a scheduler sets them (DeepSpeed's OneCycle: the trace's
        # steps[].betas), else None and the optimizer's throughout
        self.flat, self.settings, self.rates, self.betas = flat, optimizer, rates, betas
        self.A = accumulation_steps
        self.variant = dict(TRUE, **changes)
        self.m = np.zeros(flat.size, dtype=F32)
        self.v = np.zeros(flat.size, dtype=F32)

    def applies(self, step):
        """Whether the variant can differ from the true step's formula here (its neighbouring rate exists, a
        scheduler's betas for fixed_betas, a weight decay for the decay's variants, a clip for clipping's)."""
        variant, o = self.variant, self.settings
        if not 1 <= step + variant["lr_shift"] <= len(self.rates):
            return False
        if variant["fixed_betas"] and self.betas is None:
            return False
        if not o["weight_decay"] and (variant["decay"] != "decoupled" or variant["decay_set"] != "trace"):
            return False
        if o["clip"] <= 0 and variant["clipping"] != "global":
            return False
        return not (variant["counter"] == "micro_steps" and self.A == 1)

    def lr(self, t):
        variant = self.variant
        if variant["warmup_from_zero"]:
            rate = self.rates[t - 2] if t >= 2 else 0.0
        else:
            # a neighbour outside the schedule: the step's own rate (the rate of step 0 is step 1's)
            rate = self.rates[min(max(t - 1 + variant["lr_shift"], 0), len(self.rates) - 1)]
        return rate * variant["lr_factor"]

    def _betas(self, t):
        variant = self.variant
        betas = self.betas[t - 1] if self.betas and not variant["fixed_betas"] else self.settings["betas"]
        return betas[::-1] if variant["swap_betas"] else betas

    def advance(self, t, params, grad, norm):
        """Update t's (1-based) gradient before clipping `grad` (flat float32, `norm` the norm its producer
        recorded) into m and v; params: the parameters before the update (L2 decay adds wd p to the gradient)."""
        variant, o = self.variant, self.settings
        beta1, beta2 = self._betas(t)
        g = grad.copy()
        clip = o["clip"] * variant["clip_factor"]
        if variant["clipping"] == "global":
            coefficient = clip_coefficient(clip, norm)
            if coefficient != 1:
                g *= coefficient
        elif variant["clipping"] != "none" and clip > 0:
            flat = self.flat
            if variant["clipping"] == "local":
                parts = [flat.rank == r for r in range(flat.world_size)]
            elif variant["clipping"] == "per_group":
                parts = [flat.decay, ~flat.decay]
            else:
                parts = [slice(p["offset"], p["offset"] + p["numel"]) for p in flat.params]
            for part in parts:
                coefficient = clip_coefficient(clip, norm_of(grad[part]))
                if coefficient != 1:
                    g[part] *= coefficient
        if variant["decay"] == "l2" and o["weight_decay"]:
            decay = self.flat.decayed(variant["decay_set"])
            g[decay] += F32(o["weight_decay"] * variant["decay_factor"]) * params[decay]
        if variant["reset"]:
            self.m = np.zeros_like(self.m)
            self.v = np.zeros_like(self.v)
        if variant["momentum"] == "undamped":
            self.m = self.m * F32(beta1) + g
        else:
            w = F32(1.0 - beta1)  # m.lerp_(g, w), in lerp's two branches as zero2.h's adamw_update
            self.m = self.m + w * (g - self.m) if w < 0.5 else g - (g - self.m) * (F32(1.0) - w)
        if variant["v_of"] == "abs":
            self.v = self.v * F32(beta2) + F32(1.0 - beta2) * np.abs(g)
        else:
            self.v = self.v * F32(beta2) + (F32(1.0 - beta2) * g) * g

    def update(self, t, params):
        """The parameters after update t from `params`, those before it, and the state advance() left."""
        variant, o = self.variant, self.settings
        if variant["no_update"]:
            return params.copy()
        beta1, beta2 = self._betas(t)
        lr = self.lr(t)
        counted = 1 if variant["reset_counter"] else t + 1 if variant["counter"] == "ahead" else \
            t * self.A if variant["counter"] == "micro_steps" else t
        p = params.copy()
        wd = o["weight_decay"] * variant["decay_factor"]
        if wd and variant["decay"] in ("decoupled", "without_lr"):
            decay = self.flat.decayed(variant["decay_set"])
            p[decay] *= F32(1.0 - (lr if variant["decay"] == "decoupled" else 1.0) * wd)
        corrected = o["bias_correction"]
        bc1 = 1.0 - power_double(beta1, counted) if corrected and variant["correct_m"] else 1.0
        bc2 = 1.0 - power_double(beta2, counted) if corrected and variant["correct_v"] else 1.0
        eps = F32(o["eps"] if variant["eps_value"] is None else variant["eps_value"])
        if variant["eps"] == "outside":
            denominator = np.sqrt(self.v) / F32(math.sqrt(bc2)) + eps
        elif variant["eps"] == "inside":
            denominator = np.sqrt(self.v / F32(bc2) + eps)
        else:
            denominator = np.sqrt(self.v + eps) / F32(math.sqrt(bc2))
        # Padding (m = v = 0) with eps inside gives 0 / sqrt(eps) = 0: no 0 / 0 in any variant but eps = 0's,
        # where zero2 too divides 0 by 0 on padding; those elements are never compared.
        with np.errstate(invalid="ignore", divide="ignore"):
            return p + (F32(-lr / bc1) * self.m) / denominator

    def step(self, t, params, grad, norm):
        """advance() and update(): the parameters after update t."""
        self.advance(t, params, grad, norm)
        return self.update(t, params)
