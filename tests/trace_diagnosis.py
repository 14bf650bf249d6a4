"""tests/trace_diagnosis.py: what a difference between two traces points to (tests/check_trace.py; notes/12).

Given the first step and tensor where theirs and zero2's disagree, each diagnosis measures a pattern (a ratio
of N, a norm equal to one rank's shard's, a difference of -lr wd p on exactly the tensors without weight
decay, ...) and names the bug it points to; replay_step recomputes the failing step with AdamW and each of
its common mistakes (tests/peers/adamw_replay.py). `pair` is the checker's Pair: zero2's trace and theirs.
"""
import math
import os
import sys

import numpy as np

from trace_tolerances import is_finite_number, loss_tolerance, parameter_tolerances, ratio_is, same_setting, share

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import adamw_replay  # noqa: E402


class Diagnosis(str):
    """A diagnosis's words, with what it names: `named`, a class id of tests/bug_taxonomy.py (the bug named
    strictly), or `fits`, the ids that fit where several do, with `separate`, what would tell them apart.
    Concatenation keeps them (diagnosis + ". more words", "in bucket 1, " + diagnosis)."""

    def __new__(cls, text, named=None, fits=None, separate=None):
        self = super().__new__(cls, text)
        self.named, self.fits, self.separate = named, fits, separate
        return self

    def __add__(self, other):
        return Diagnosis(str.__add__(self, other), self.named, self.fits, self.separate)

    def __radd__(self, other):
        return Diagnosis(str.__add__(other, self), self.named, self.fits, self.separate)


def named_line(diagnosis):
    """The line after "diagnosis:" (the corpus scorer parses it): "named: ID", "fits: ID, ID (not told apart:
    ...)", or "named: none"."""
    if getattr(diagnosis, "named", None):
        return f"named: {diagnosis.named}"
    if getattr(diagnosis, "fits", None):
        return f"fits: {', '.join(diagnosis.fits)} (not told apart: {diagnosis.separate})"
    return "named: none"


# ----------------------------------------------------------------------------
# Diagnoses: what pattern of difference points to which bug

def diagnose_lr(pair, step, theirs, mine):
    """Their recorded rate differs from zero2's at `step`. Which schedules fit every rate theirs records (a
    diagnosis may read past the failing step; the verdict does not): each rate zero2's of the step after, of the
    step before, a constant factor of zero2's (lr x N), or a warmup counted from 0 (0 at step 1, then the step
    before's). One that fits alone is named; several are said with the step that would separate them."""
    ref = [r["lr"] for r in pair.ref.steps]
    their = [r.get("lr") for r in pair.theirs.steps[:len(ref)]]
    same = lambda a, b: a is not None and same_setting(a, b)
    S = len(ref)
    ratio = theirs / mine if mine else None
    # With one step recorded, the step after's rate is unknown: that hypothesis stands unrefuted.
    candidates = {
        "schedule.lr-of-step-after": all(same(their[t], ref[t + 1]) for t in range(S - 1)),
        "schedule.lr-of-step-before": all(same(their[t], ref[t - 1]) for t in range(1, S))
        and same(their[0], ref[0]) and S > 1,
        "schedule.warmup-from-zero": S > 1 and same(their[0], 0.0) and all(same(their[t], ref[t - 1]) for t in range(1, S)),
        "schedule.lr-scaled": ratio is not None and ratio != 1 and
        all(same(their[t], ratio * ref[t]) for t in range(S) if ref[t]),
    }
    fits = [c for c, ok in candidates.items() if ok]
    words = {"schedule.lr-of-step-after": "each rate is zero2's of the step after: the schedule runs one step ahead "
                                          "(the scheduler stepped before the optimizer)",
             "schedule.lr-of-step-before": "each rate is zero2's of the step before: the schedule lags one step",
             "schedule.warmup-from-zero": "the rate is 0 at step 1 and zero2's of the step before after it: the "
                                          "warmup counts from 0",
             "schedule.lr-scaled": f"every rate is {ratio:.4g} x zero2's" + (
                 " (= N, the ranks: the linear scaling rule)" if ratio and abs(ratio - pair.N) < 1e-6 * pair.N else "")
             if ratio else ""}
    if len(fits) == 1:
        return Diagnosis(f"{words[fits[0]]}, at every step theirs records", fits[0])
    if fits:
        def predicted(c, t):  # hypothesis c's rate at step t + 1, or None where the trace cannot say
            if c == "schedule.lr-of-step-after":
                return ref[t + 1] if t + 1 < S else None
            if c == "schedule.lr-scaled":
                return ratio * ref[t]
            return ref[t - 1] if t > 0 else (ref[0] if c == "schedule.lr-of-step-before" else 0.0)
        differ = next((t + 1 for t in range(S)
                       if len({round(v, 15) for v in (predicted(c, t) for c in fits) if v is not None}) > 1), None)
        separate = (f"their rates agree with each of these at the {S} step(s) recorded" +
                    (f"; they differ at step {differ}" if differ is not None else
                     f"; zero2's rate of step {S + 1} would tell them apart: trace one step more" if S == 1 else ""))
        return Diagnosis("the rates theirs records fit more than one schedule: " +
                         "; or ".join(words[c] for c in fits), fits=fits, separate=separate)
    return Diagnosis("the learning rate differs: set each step's rate from the trace's steps[].lr (or, with a "
                     "DeepSpeed config, let DeepSpeed's scheduler set it and compare)")


def diagnose_loss(pair, step, theirs, mine, gradients_agree=False, generic=True):
    """What a loss that differs points to; None where no pattern fits. generic: at step 1, where nothing
    else fits, say where a loss computed from the same weights and batch can differ (the model, the batch)."""
    record = pair.ref.steps[step - 1]
    losses, selected = record.get("micro_batch_losses"), record.get("micro_batch_selected")
    tolerance = 8 * loss_tolerance(mine, step, pair.precision, pair.selected(step))
    if losses and selected and None not in losses:
        total = sum(selected)
        summed = [loss * total for loss in losses]  # each micro-batch's summed cross-entropy
        M, N = len(losses), pair.N
        ranks = [(sum(summed[m] for m in range(r, M, N)), sum(selected[m] for m in range(r, M, N))) for r in range(N)]
        per_rank = np.mean([s / c for s, c in ranks if c > 0])
        per_micro_batch = np.mean([s / c for s, c in zip(summed, selected) if c > 0])
        # A pattern names a bug only where it differs from zero2's loss (N = 1, or ranks that select equally
        # many positions, make the per-rank mean the global one).
        distinct = lambda value: abs(value - mine) > 2 * tolerance
        if distinct(per_rank) and abs(theirs - per_rank) <= tolerance:
            return Diagnosis("theirs is the mean of the ranks' own means (each rank averaging over its own selected "
                             "positions, "
                    "as Hugging Face's loss does), not the mean over the selected positions of the whole global batch: "
                    f"the ranks select {[c for _, c in ranks]} positions, so their means weigh differently. Sum each "
                    "rank's cross-entropy and divide by the global batch's count (times N where DDP averages)",
                             "loss.mean-of-rank-means")
        if pair.A > 1 and distinct(per_micro_batch) and abs(theirs - per_micro_batch) <= tolerance:
            return Diagnosis("theirs is the mean of the micro-batches' own means, not the mean over the whole global "
                             "batch's selected positions: accumulate summed cross-entropy and divide once by the "
                             "global count", "loss.mean-of-micro-batch-means")
        own = ranks[0][0] / ranks[0][1] if ranks[0][1] else None  # rank 0's rows alone, as N copies of them give
        if N > 1 and own is not None and distinct(own) and abs(theirs - own) <= tolerance:
            return Diagnosis("theirs is the mean over rank 0's micro-batches alone: every rank read rank 0's rows "
                             "(the rank left out of the sampler's offset), so the global batch is N copies of one "
                             "rank's; global micro-batch m = a N + r is rank r's", "data.rank-rows-duplicated")
        if abs(theirs - mine * total) <= tolerance * total:
            return Diagnosis("theirs is the summed cross-entropy, not its mean over the global batch's selected "
                             "positions", "loss.summed-cross-entropy")
    named = loss_factor_diagnosis(pair, theirs, mine, tolerance, gradients_agree)
    if named:
        return named
    if step == 1 and generic:
        # What a loss from the same weights can differ by, without a pattern that names one: the forward pass,
        # or the data it was fed. A trace holds zero2's loss and gradients, not the forward's inner values nor
        # the rows a peer read, so these are said together, not named.
        return Diagnosis("from the same weights and the same batch the loss differs, so the forward pass or the loss "
                         "does: the model (BertForMaskedLM: GELU in its erf form, LayerNorm eps 1e-12, one token type, "
                         "no attention mask), the batch's rows (micro-batch m = a N + r), labels -100 not selected",
                         fits=["loss.forward-differs", "data.batch-of-next-step", "data.labels-all-positions"],
                         separate="a trace records neither the forward's inner values nor the rows a peer read: "
                                  "compare your loss on step 1's rows with zero2's micro_batch_losses one micro-batch "
                                  "at a time, with -100 labels left out")
    return None


def loss_factor_diagnosis(pair, theirs, mine, tolerance, gradients_agree):
    """A loss N or A times zero2's, or 1 / that: the loss's convention (the trace's conventions.loss: the mean
    over the global batch's selected positions, every rank's micro-batches counted once). Where the gradients
    of the step agree, only what is recorded as the loss differs, not what was differentiated."""
    N, A = pair.N, pair.A
    recorded = (" (the gradients of this step agree: only the value recorded as the loss is scaled, not the loss "
                "that was differentiated)") if gradients_agree else ""
    for factor, which, how in ((N, "N", "number of ranks"), (A, "A", "number of micro-steps")):
        if factor <= 1 or (which == "A" and A == N):
            continue
        both = " (or A: N = A here)" if which == "N" and A == N else ""
        summed = ["loss.summed-over-ranks", "loss.summed-over-micro-steps"]
        divided = ["loss.divided-by-N", "loss.divided-by-A"]
        same = "N = A here: a run with another A than N tells them apart"
        if abs(theirs - mine * factor) <= tolerance * factor:
            return Diagnosis(f"theirs is {theirs / mine:.4f} x zero2's = {which}{both}: the loss is scaled by the "
                             f"{how}: summed over them where zero2 records the mean over the whole global "
                             f"batch{recorded}", None if A == N else summed[which == "A"],
                             summed if A == N else None, same)
        if abs(theirs * factor - mine) <= tolerance:
            by_ranks = ("each rank's part was divided by N again, after the mean over the global batch counted "
                        "every rank")
            by_steps = ("each micro-batch's loss was divided by the A micro-steps (as Hugging Face's Trainer divides "
                        "by gradient_accumulation_steps) on top of the mean over the global batch, which already "
                        "counts every micro-step's positions")
            words = by_steps if which == "A" else by_ranks if A != N else f"{by_ranks}; or (A) {by_steps}"
            return Diagnosis(f"theirs is {theirs / mine:.4f} x zero2's = 1 / {which}{both}: the loss is scaled by "
                             f"the {how}: {words}{recorded}", None if A == N else divided[which == "A"],
                             divided if A == N else None, same)
    return None


def factor_diagnosis(pair, ratio):
    """A gradient N or A times zero2's (or 1 / that): what was summed where it is averaged, or averaged twice.
    A factor of N names the ranks, of A the micro-steps; where N = A either may be it."""
    N, A = pair.N, pair.A
    factors = [(N, "N", f"the {N} ranks")] * (N > 1) + [(A, "A", f"the {A} micro-steps")] * (A > 1 and A != N) \
        + [(N * A, "N A", f"both the {N} ranks and the {A} micro-steps")] * (N > 1 and A > 1)
    summed = {"N": "reduction.summed", "A": "accumulation.summed-not-averaged"}
    averaged = {"N": "reduction.averaged-twice", "A": "loss.divided-by-A"}
    same = "N = A here: a run with another A than N tells them apart"
    for factor, which, over in factors:
        both = " (or A: N = A here)" if which == "N" and A == N else ""
        if ratio_is(ratio, factor):
            return Diagnosis(f"theirs is {ratio:.4f} x zero2's = {which}{both}: the gradients were summed over "
                             f"{over}, not averaged (the reduction sums: divide by {which}, or scale each rank's loss "
                             f"as the trace's conventions.loss says)",
                             None if both else summed.get(which), list(summed.values()) if both else None, same)
        if ratio_is(ratio, 1 / factor):
            return Diagnosis(f"theirs is {ratio:.4f} x zero2's = 1 / {which}{both}: the gradients were averaged over "
                             f"{over} twice (the loss already carries 1 / {which}, or the reduction divides after "
                             f"DDP did)", None if both else averaged.get(which),
                             list(averaged.values()) if both else None, same)
    return None


def diagnose_norm(pair, step, theirs, mine, gradients_agree=False):
    """What a gradient norm that differs points to. gradients_agree: the step's gradients were compared and
    agree, so the norm was taken of something else than the gradient the step used."""
    N, A = pair.N, pair.A
    if not mine:
        return None
    ratio = theirs / mine
    scale = pair.ref.steps[step - 1].get("loss_scale")
    if pair.precision == "fp16" and is_finite_number(scale) and scale > 1 and ratio_is(ratio, scale):
        return Diagnosis(f"theirs is {ratio:.6g} x zero2's = the step's loss scale {scale:g}: the norm was taken of "
                         f"the gradient still carrying the loss scale, so the clip coefficient is off by it too "
                         f"(divide the scale out before the norm and the clip, as DeepSpeed's unscale_and_clip_grads "
                         f"does)", "precision.loss-scale-in-norm")
    if gradients_agree:
        for factor, which in ((N, "N"), (A, "A")):
            if factor <= 1 or (which == "A" and A == N):
                continue
            if ratio_is(ratio, factor) or ratio_is(ratio, 1 / factor):
                both = f" (or {'A' if which == 'N' else 'N'}: N = A here)" if N == A else ""
                when = "before dividing by" if ratio > 1 else "after dividing twice by"
                return Diagnosis(f"the gradients of this step agree with zero2's, but the norm is {ratio:.4f} x "
                                 f"zero2's = {'' if ratio > 1 else '1 / '}{which}{both}: the norm was computed {when} "
                                 f"{which}, of the summed gradient and not the averaged one that the step uses "
                                 f"(compute the norm, and the clip coefficient from it, after the reduction's average)",
                                 None if which == "A" else
                                 "clipping.norm-before-average" if ratio > 1 else "clipping.norm-averaged-twice")
    else:
        named = factor_diagnosis(pair, ratio)
        if named:
            return named
    gradients = pair.tensors("ref", "gradients", step) if step in pair.ref.parameter_steps else None
    if gradients is not None and N > 1:
        squares = {}
        for (b, r), values in pair.shard_views(gradients).items():
            squares[r] = squares.get(r, 0.0) + float(np.dot(values, values))
        for r, sum_squares in sorted(squares.items()):
            if abs(theirs - math.sqrt(sum_squares)) <= 1e-4 * mine:
                return Diagnosis(f"theirs is the norm of rank {r}'s own shard alone ({math.sqrt(sum_squares):.6g}; "
                                 f"the whole gradient's is {mine:.6g}): in ZeRO-2 each rank holds only its shard of "
                                 f"the reduced gradient, so the squares must be summed over all ranks (an all-reduce) "
                                 f"before the square root", "clipping.norm-own-shard")
    elif N > 1 and ratio < 1 and abs(ratio * ratio * N - 1) < 0.5:
        return (f"theirs is {ratio:.4f} x zero2's ({ratio * ratio:.3f} of the squares, 1 / N = {1 / N:.3f}): it may "
                f"be the norm of one rank's shard (sum every rank's squares before the square root); keep this "
                f"step's gradients (--trace-params-every) to tell")
    return None


def close_to(x, y, tolerance):
    return float(np.median(np.abs(x - y))) <= tolerance


class ShardUpdates:
    """Each (bucket, rank) shard after a step, judged by its median against the tolerance: updated as zero2's
    (fresh), still holding zero2's values from before the step (stale), or neither (other). A shard zero2 did not
    move either (unused embedding rows, no decay) tells nothing and is in none. theirs, mine: {name: values
    after the step}; before: zero2's after the step before."""

    def __init__(self, pair, theirs, mine, before, tolerance):
        self.theirs, self.mine, self.before = (pair.shard_views(v) for v in (theirs, mine, before))
        self.fresh, self.stale, self.other = [], [], []
        for key, values in self.theirs.items():
            if close_to(self.mine[key], self.before[key], tolerance):
                continue
            if close_to(values, self.mine[key], tolerance):
                self.fresh.append(key)
            elif close_to(values, self.before[key], tolerance):
                self.stale.append(key)
            else:
                self.other.append(key)


def diagnose_stale_shards(pair, shards):
    """Whole ranks' or whole buckets' shards holding their values from before the step while the others are
    updated (shards: ShardUpdates): the all-gather's order or a bucket left out."""
    fresh, stale = shards.fresh, shards.stale
    if not (stale and fresh):
        return None
    stale_ranks, fresh_ranks = sorted({r for _, r in stale}), sorted({r for _, r in fresh})
    stale_buckets, fresh_buckets = sorted({b for b, _ in stale}), sorted({b for b, _ in fresh})
    if not set(stale_ranks) & set(fresh_ranks):  # whole ranks: every bucket's shard of a rank alike
        if len(fresh_ranks) == 1:
            return Diagnosis(f"the shards of rank(s) {stale_ranks} (every bucket) still hold their values from before "
                             f"this step, rank(s) {fresh_ranks}'s are updated: the all-gather ran before the update "
                             f"(or gathered the buffer from before it, or its result was not copied back), so the "
                             f"rank whose copy this is sees only its own shard's update",
                             fits=["sharding.stale-all-gather", "sharding.rank-skips-all-gather"],
                             separate="the trace holds one rank's copy, which sees only its own shard updated in "
                                      "either; an all-gather that runs before the update does so at every step, a "
                                      "rank left out of one all-gather at one: keep the steps after "
                                      "(--trace-params-every 1)")
        return Diagnosis(f"the shards of rank(s) {stale_ranks} (every bucket) still hold their values from before "
                         f"this step, rank(s) {fresh_ranks}'s are updated: rank(s) {stale_ranks} sent their shards "
                         f"from before the update to the all-gather (or did not step)",
                         "sharding.rank-skips-all-gather")
    if not set(stale_buckets) & set(fresh_buckets):  # whole buckets: every rank's shard of a bucket alike
        names = [n for n, p in pair.params.items() if p["bucket"] in stale_buckets]
        return Diagnosis(f"bucket(s) {stale_buckets} ({names[0]}, ...) still hold their values from before this step "
                         f"on every rank, the other buckets are updated: those parameters were left out of the update "
                         f"(a parameter group missing from the optimizer, or a bucket whose reduction never "
                         f"completed)", "state.group-not-updated")
    return None


def diagnose_parameters(pair, step, theirs, mine, before, shards, lr, weight_decay, tolerance):
    """theirs, mine: {name: values after `step`}; before: zero2's after step - 1 (the initial weights at 1);
    shards: their ShardUpdates (whole ranks' or buckets' stale shards were judged before, diagnose_stale_shards)."""
    # A whole update missing.
    shards_theirs, shards_mine, shards_before = shards.theirs, shards.mine, shards.before
    if shards.stale and not shards.fresh and not shards.other:
        return Diagnosis("every parameter still holds its value from before this step: the update never reached the "
                         "weights (the optimizer stepped a copy, or the all-gather sent the parameters from before "
                         "the update)", "state.update-not-applied")
    # A shard holding the neighbouring shard's values.
    for key in shards.other:
        b, r = key
        for neighbour in ((b, (r + 1) % pair.N), (b, (r - 1) % pair.N)):
            if neighbour == key or neighbour not in shards_mine:
                continue
            mine_there = shards_mine[neighbour]
            if len(mine_there) != len(shards_theirs[key]):
                continue
            moved = max(np.abs(shards_before[neighbour] - mine_there).max(), 1e-30)
            if np.abs(shards_theirs[key] - mine_there).max() <= 2 * moved + tolerance or \
                    np.abs(shards_theirs[key] - shards_before[neighbour]).max() <= 2 * moved + tolerance:
                return Diagnosis(f"rank {r}'s shard of bucket {b} holds what zero2 has in rank {neighbour[1]}'s "
                                 f"shard: a shard offset off by one rank (shard r starts at bucket offset + r x "
                                 f"shard_length; the all-to-all sends slice j to rank j and the all-gather puts rank "
                                 f"j's shard back at slice j)", "sharding.offset-off-by-one")
    # Weight decay where none belongs, or none where it belongs.
    differences = {name: np.asarray(theirs[name], np.float64) - np.asarray(mine[name], np.float64) for name in mine}
    wd_step = lr * weight_decay
    if wd_step > 0:
        def explained_by_decay(names, sign):
            ratios = []
            for name in names:
                predicted = sign * wd_step * np.asarray(before[name], np.float64)
                big = np.abs(predicted) > 10 * tolerance
                if big.any():
                    ratios.append(float(np.median(differences[name][big] / predicted[big])))
            return ratios and all(abs(x - 1) < 0.2 for x in ratios)
        off = [n for n in mine if not close_to(theirs[n], mine[n], tolerance)]
        if off and all(n in pair.no_decay for n in off) and explained_by_decay(off, -1):
            return Diagnosis(f"the tensors that differ are exactly those without weight decay (biases, LayerNorm: "
                             f"{off[0]}, ...), each by -lr x wd x p: weight decay was applied to them; leave the "
                             f"biases and LayerNorm weights out of AdamW's decay (the trace's "
                             f"optimizer.no_weight_decay)",
                             "adamw.decay-everything")
        if off and all(n not in pair.no_decay for n in off) and explained_by_decay(off, 1):
            return Diagnosis(f"the tensors that differ are exactly those with weight decay ({off[0]}, ...), each by "
                             f"+lr x wd x p: theirs applied no weight decay", "adamw.no-decay")
    # The update's size: AdamW without its bias corrections is a fixed multiple of it.
    updates_theirs = np.concatenate([(np.asarray(theirs[n], np.float64) - before[n]).reshape(-1) for n in mine])
    updates_mine = np.concatenate([(np.asarray(mine[n], np.float64) - before[n]).reshape(-1) for n in mine])
    moving = np.abs(updates_mine) > 10 * tolerance
    if moving.any():
        ratio = float(np.median(updates_theirs[moving] / updates_mine[moving]))
        beta1, beta2 = pair.ref.optimizer["betas"]
        t = step  # AdamW's t: the updates so far (fp16's skipped steps aside)
        uncorrected = (1 - beta1 ** t) / math.sqrt(1 - beta2 ** t)
        if pair.ref.optimizer["bias_correction"] and ratio_is(ratio, uncorrected, 0.02):
            return Diagnosis(f"theirs moved every parameter {ratio:.3f} x as far as zero2 = (1 - beta1^t) / "
                             f"sqrt(1 - beta2^t) at t = {t}: AdamW without its bias corrections (m / (1 - beta1^t), "
                             f"v / (1 - beta2^t))", "adamw.no-bias-correction")
        if abs(ratio - 1) > 0.05 and np.std(updates_theirs[moving] / updates_mine[moving]) < 0.05 * abs(ratio):
            return (f"theirs moved every parameter {ratio:.3f} x as far as zero2: the learning rate or the update's "
                    f"scale differs")
    return None


# ----------------------------------------------------------------------------
# Replaying the failing step: AdamW and a hypothesis for each class of mistake (tests/peers/adamw_replay.py)
#
# A pattern (a ratio, a set of tensors) points to a bug; a replay shows it. From the parameters before the
# failing step, the state (m, v) before it and the step's gradient, AdamW as the trace states it and every
# hypothesis of adamw_replay.HYPOTHESES (one per class of tests/bug_taxonomy.py that a replay recomputes)
# compute the parameters after the step; a hypothesis that lands on theirs within one step's tolerance, where
# the true formula does not, fits. The state is recomputed from step 1 by each hypothesis's own formula
# (betas swapped change m and v, not step 1's update: AdamW's first step is sign(g) whatever the betas), so
# the replay needs every step's gradient up to the failing one, theirs where kept (the one their optimizer
# read), else zero2's, and the parameters before it: a trace made with --trace-params-every 1, replayed by a
# peer that keeps what the trace keeps.
#
# A class is named only where one hypothesis alone fits. Where several do (lr x 2 and the rate of the step
# after give one rate at step 1 under a linear warmup), the steps after the failing one that both traces keep
# are replayed, from their parameters at each, every hypothesis carrying its own state and fitted factor, and
# those that stop fitting are dropped; what is left is said, with what would separate it.
#
# Mixed precision (bf16): zero2's master weights are fp32, and the gradient its trace records is the one the
# master's AdamW reads (the reduced gradient, bf16 values held in fp32), so the step replays on the fp32 master
# as in fp32, with two differences. The start: a peer's master may begin from its 16-bit model (DeepSpeed's
# does), so step 1 replays from zero2's initial weights or their bf16 rounding, whichever the true step lands
# nearer theirs from. The tolerance: the checker's own for bf16 parameters (parameter_tolerances(lr, "bf16"):
# 4 x bf16's spacing x lr for the median, 312 x fp32's; 2.5 lr for the largest), where fp32's is 1e-4 lr.
# Why wider: a peer whose optimizer reads a gradient other than the one it records (rounded to 16 bits after
# it was recorded, or before a reduction its trace does not see) moves AdamW's step by about twice that
# gradient's relative error (m and v each carry it), 2 x 2^-9 of lr for one bf16 rounding, 40 x fp32's median
# tolerance; a hypothesis is said to fit where the checker itself would pass it. Measured (make check-peer
# PEER=torch has no bf16 peer; tests/test_hypotheses.py): zero2 --portable's bf16 trace (every step kept, 20
# steps) against zero2's is replayed exactly (0 of the tolerance at every step, the same arithmetic on the same
# inputs), and so is a synthetic peer whose master starts from the bf16 weights, once the start is chosen; the
# bf16 mistakes planted there fail by 5 to 1,100 x and are named. fp16 is not replayed: its loss scale and
# skipped steps change t and the gradient the optimizer read.

def describe_factor(k, pair):
    """A fitted factor, and what it equals where it is N, A, N A or 1 / one of them."""
    N, A = pair.N, pair.A
    for value, what in ((N, "N, the number of ranks"), (A, "A, the number of micro-steps"), (N * A, "N A")):
        if value > 1 and ratio_is(k, value, 2e-3):
            return f"{k:.4g} (= {what})"
        if value > 1 and ratio_is(k, 1 / value, 2e-3):
            return f"{k:.4g} (= 1 / {what})"
    return f"{k:.4g}"


def replay_sources(pair, last):
    """For each step 1 .. last: (whose gradient, whose parameters before it), theirs where kept; or a message
    saying which is kept by neither trace."""
    ref, theirs = pair.ref, pair.theirs
    sources = []
    for t in range(1, last + 1):
        side = "theirs" if theirs.parameter_steps.get(t) else "ref" if ref.parameter_steps.get(t) else None
        before = ("ref" if t == 1 else "theirs" if (t - 1) in theirs.parameter_steps
                  else "ref" if (t - 1) in ref.parameter_steps else None)
        if side is None or before is None:
            return None, (f"The replay of AdamW's step (and its common mistakes) needs the gradient of every step "
                          f"1 .. {last} and the parameters before each: step {t}'s "
                          f"{'gradient' if side is None else 'parameters before it'} is kept by neither trace "
                          f"(make zero2's trace with --trace-params-every 1)")
        sources.append((side, before))
    return sources, None


def bfloat16(values):
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def replay_step(pair, step):
    """(named, measured). named: a Diagnosis where one hypothesis (or several, said as such) reproduces theirs
    after `step` and the true formula does not; else None, and measured says what the replay found (or why it
    could not run)."""
    if pair.precision not in ("fp32", "bf16"):
        return None, None  # fp16's step reads a loss scale and may be skipped: not replayed
    ref, theirs = pair.ref, pair.theirs
    sources, missing = replay_sources(pair, step)
    if missing:
        return None, missing

    def read(side, kind, t):  # not cached in pair: a long replay would hold every step's tensors
        cached = (side, kind, t) in pair._read
        values = pair.tensors(side, kind, t)
        if not cached:
            del pair._read[(side, kind, t)]
        return values

    flat = adamw_replay.Flat(pair.layout, pair.no_decay, pair.N)
    rates = [record["lr"] for record in ref.steps]
    betas = [record["betas"] for record in ref.steps] if all("betas" in r for r in ref.steps) else None

    def replay(changes):
        return adamw_replay.Replay(flat, ref.optimizer, rates, changes, betas, pair.A)

    def inputs(t, side, before_side):
        norm = (theirs if side == "theirs" else ref).steps[t - 1]["grad_norm"]
        before = flat.flat(read(before_side, "parameters", t - 1))
        if t == 1 and start_rounded:
            before = bfloat16(before)
        return before, flat.flat(read(side, "gradients", t)), norm

    # In bf16 a peer's fp32 master may start from its 16-bit model (DeepSpeed's does), zero2's from the fp32
    # weights: the replay starts from the one whose true step lands nearer theirs after step 1.
    start_rounded = False
    if pair.precision == "bf16" and 1 in theirs.parameter_steps:
        after_1 = flat.flat(read("theirs", "parameters", 1))
        distances = []
        for start_rounded in (False, True):
            b, g, n = inputs(1, *sources[0])
            distances.append(float(np.sum((replay({}).step(1, b, g, n) - after_1).astype(np.float64) ** 2)))
        start_rounded = distances[1] < distances[0]

    true = replay({})
    entries = []  # [class id, alternative, Replay]
    for id, hypothesis in adamw_replay.HYPOTHESES.items():
        for k, changes in enumerate(hypothesis["changes"]):
            entry = replay(changes)
            if entry.applies(step) and not (hypothesis["fit"] == "decay" and not ref.optimizer["weight_decay"]) \
                    and not (hypothesis["fit"] == "clip" and ref.optimizer["clip"] <= 0):
                entries.append((id, k, entry))
    kept = []  # each step's inputs, for a fitted clipping threshold's replays from step 1
    # Hypotheses that change only the update from the state share one m and v (advanced once, the arrays
    # shared: advance() makes new ones, nothing writes them in place): a dozen states, not one per hypothesis.
    groups = {}
    for r in [true] + [e[2] for e in entries]:
        groups.setdefault(adamw_replay.state_key(r.variant), []).append(r)
    for t, (side, before_side) in enumerate(sources, start=1):
        before, gradient, norm = inputs(t, side, before_side)
        if flat.size * step <= 5e7:
            kept.append((before, gradient, norm))
        for first, *others in groups.values():
            first.advance(t, before, gradient, norm)
            for r in others:
                r.m, r.v = first.m, first.v
    # One update's tolerance where the replay starts from theirs' own parameters (it then differs from theirs
    # by one update's rounding), the checker's, summed over the steps, where it starts from zero2's.
    own_start = step == 1 or sources[-1][1] == "theirs"
    lrs = [rates[step - 1]] if own_start else rates[:step]
    target_tensors = pair.tensors("theirs", "parameters", step)
    target = flat.flat(target_tensors)

    def tolerances(lr_sum):
        return parameter_tolerances(lr_sum, pair.precision)

    def excess(result, against, limits):  # the checker's measure: the worst tensor's median or largest
        median_tolerance, largest_tolerance = limits
        worst = 0.0
        for name, values in flat.tensors(result).items():
            difference = np.abs(values.astype(np.float64) - np.asarray(against[name], np.float64).reshape(-1))
            median = 0.0 if name in pair.noise else float(np.median(difference))
            worst = max(worst, share(median, median_tolerance), share(float(difference.max(initial=0.0)),
                                                                       largest_tolerance))
        return worst

    limits = tolerances(sum(lrs))
    true_result = true.update(step, before)
    true_score = excess(true_result, target_tensors, limits)
    true_tensors = flat.tensors(true_result)
    fitted = {}  # class id: its factor, described
    real = flat.real

    def squares(result):
        d = result[real].astype(np.float64) - target[real]
        return float(np.dot(d, d))

    def search(evaluate, low, high, points=25):
        """The log-factor in [low, high] that makes evaluate smallest: a grid, then golden sections; None where
        the smallest is at an end of the range (no optimum inside it: the factor does not explain theirs)."""
        grid = np.linspace(low, high, points)
        values = [evaluate(x) for x in grid]
        i = int(np.argmin(values))
        if i in (0, points - 1):
            return None
        a, b = grid[max(i - 1, 0)], grid[min(i + 1, points - 1)]
        golden = (math.sqrt(5) - 1) / 2
        for _ in range(30):
            c, d = b - golden * (b - a), a + golden * (b - a)
            if evaluate(c) < evaluate(d):
                b = d
            else:
                a = c
        return (a + b) / 2

    kept_entries = []
    for id, k, entry in entries:
        fit = adamw_replay.HYPOTHESES[id]["fit"]
        if fit == "lr":  # linear in lr: theirs - before = k (true - before)
            change = true_result[real].astype(np.float64) - before[real]
            factor = float(np.dot(target[real] - before[real], change) / np.dot(change, change)) \
                if np.dot(change, change) > 0 else math.nan
            if not math.isfinite(factor) or abs(factor) < 1e-2:
                continue  # no movement at all: state.update-not-applied's
            entry.variant["lr_factor"] = factor
            fitted[id] = f"lr x {describe_factor(factor, pair)}"
        elif fit == "decay":  # theirs - true = -(c - 1) lr wd p on the decayed elements
            decayed = flat.decay
            q = (true.lr(step) * ref.optimizer["weight_decay"]) * before[decayed].astype(np.float64)
            if not np.dot(q, q) > 0:
                continue
            factor = 1.0 - float(np.dot(target[decayed] - true_result[decayed].astype(np.float64), q) / np.dot(q, q))
            entry.variant["decay_factor"] = factor
            decay = factor * ref.optimizer["weight_decay"]
            fitted[id] = f"weight decay x {describe_factor(factor, pair)} ({decay:.4g})"
        elif fit == "eps":
            def evaluate(x):
                entry.variant["eps_value"] = 10.0 ** x
                return squares(entry.update(step, before))
            x = search(evaluate, -14.0, -1.0)
            if x is None:
                continue
            entry.variant["eps_value"] = 10.0 ** x
            fitted[id] = f"eps {10.0 ** x:.3g} (the trace's {ref.optimizer['eps']:g})"
        elif fit == "clip":
            if len(kept) != step:
                continue

            def evaluate(x, keep=False):
                r = replay({"clip_factor": 10.0 ** x})
                for t, (b, g, n) in enumerate(kept, start=1):
                    r.advance(t, b, g, n)
                return r if keep else squares(r.update(step, before))
            x = search(evaluate, -1.0, 1.0, 17)  # a threshold 0.1 to 10 x the trace's
            if x is None:
                continue
            entry = evaluate(x, keep=True)
            factor = 10.0 ** x
            fitted[id] = f"clip x {describe_factor(factor, pair)} ({factor * ref.optimizer['clip']:.4g})"
        kept_entries.append((id, k, entry))

    scored = {}  # class id: (score, Replay, result), the nearest of its alternatives
    for id, k, entry in kept_entries:
        result = entry.update(step, before)
        if excess(result, true_tensors, limits) <= 1:
            continue  # equal to the true step here: tells nothing
        score = excess(result, target_tensors, limits)
        if id not in scored or score < scored[id][0]:
            scored[id] = (score, entry, result)
    whose = {s for s, _ in sources}
    origin = ("the initial weights" if step == 1 else
              ("their" if own_start else "zero2's") + f" parameters after step {step - 1}")
    gradients = ("theirs" if whose == {"theirs"} else "zero2's" if whose == {"ref"} else
                 "theirs where kept, else zero2's")
    origin += " (rounded to bf16, as their master starts)" if start_rounded and step == 1 else ""
    started = (f"replaying step {step} from {origin}, with AdamW's state recomputed from the gradients of steps "
               f"1 .. {step} ({gradients})" + (" on the fp32 master, to bf16's tolerance" if pair.precision == "bf16"
                                               else ""))
    if true_score <= 1:
        return None, (f"The replay reproduces theirs with AdamW as the trace states it ({started}: {true_score:.2g} "
                      f"of the tolerance): the update itself is right; what differs came in with its inputs")

    def name(id):
        hypothesis = adamw_replay.HYPOTHESES[id]
        return hypothesis["name"] + (f" ({fitted[id]})" if id in fitted else "")

    fits = {id: entry for id, entry in scored.items() if entry[0] <= 1}
    for id in list(fits):  # a family at the value of one of its members: the member is named
        if any(member in fits for member in adamw_replay.HYPOTHESES[id]["generalises"]):
            del fits[id]
    # The steps before the failing one that theirs keeps agreed with zero2's: a hypothesis that would have
    # moved theirs elsewhere there is refuted (the warmup from 0 moves nothing at step 1, where the rate of the
    # step before is step 1's own), replayed again from step 1 with its fitted factor.
    refuted = {}
    comparable = [t for t in range(1, step)
                  if t in theirs.parameter_steps and (t == 1 or sources[t - 1][1] == "theirs")]
    for id in list(fits) if comparable else []:
        again = replay({k: v for k, v in fits[id][1].variant.items() if adamw_replay.TRUE[k] != v})
        for t in range(1, max(comparable) + 1):
            b, g, n = kept[t - 1] if len(kept) == step else inputs(t, *sources[t - 1])
            again.advance(t, b, g, n)
            if t in comparable:
                score = excess(again.update(t, b), read("theirs", "parameters", t), tolerances(rates[t - 1]))
                if score > 1:
                    refuted[id] = (t, score)
                    del fits[id]
                    break
    if refuted and not fits:
        return None, (f"The replay named no mistake of AdamW: {started}, AdamW as the trace states it is "
                      f"{true_score:.3g} x the tolerance from theirs; "
                      + ", ".join(f"\"{name(id)}\"" for id in refuted) + " reproduce"
                      + ("s" if len(refuted) == 1 else "") + f" step {step} but not the steps before, where theirs "
                      f"agreed with zero2 (" + "; ".join(f"{name(id)}: {score:.3g} x at step {t}"
                                                         for id, (t, score) in refuted.items()) + ")")
    if not fits:
        nearest = min(((score, id) for id, (score, _, _) in scored.items()), default=None)
        return None, (f"The replay named no mistake of AdamW: {started}, AdamW as the trace states it is "
                      f"{true_score:.3g} x the tolerance from theirs" +
                      (f", and the nearest of {len(scored)} hypotheses (tests/peers/adamw_replay.py), "
                       f"\"{name(nearest[1])}\" ({nearest[1]}), {nearest[0]:.3g} x" if nearest else ""))
    first_scores = {id: entry[0] for id, entry in fits.items()}
    # Several fit: the steps after, from their parameters at each, each hypothesis with its own state.
    further, last, dropped = step, step, {}
    while len(fits) > 1 and further < len(ref.steps):
        t = further + 1
        side = "theirs" if theirs.parameter_steps.get(t) else "ref" if ref.parameter_steps.get(t) else None
        if side is None or t not in theirs.parameter_steps or (t - 1) not in theirs.parameter_steps:
            break
        before_t, gradient, norm = inputs(t, side, "theirs")
        goal = read("theirs", "parameters", t)
        for id in list(fits):
            entry = fits[id][1]
            entry.advance(t, before_t, gradient, norm)
            score = excess(entry.update(t, before_t), goal, tolerances(rates[t - 1]))
            if score > 1:
                dropped[id] = (t, score)
                del fits[id]
        further = last = t
    if not fits:
        return None, (f"The replay named no mistake of AdamW: {started}, "
                      + ", ".join(f"\"{name(id)}\" fits it" for id in first_scores)
                      + ", but none fits the steps after it ("
                      + "; ".join(f"{name(id)}: {score:.3g} x at step {t}" for id, (t, score) in dropped.items())
                      + "); AdamW as the trace states it is " + f"{true_score:.3g} x the tolerance from theirs")
    earlier = "" if not refuted else \
        ("; " + ", ".join(f"{name(id)} (which fits it too) would have put theirs elsewhere at step {t} "
                          f"({score:.3g} x), where theirs agreed with zero2" for id, (t, score) in refuted.items()))
    later = earlier + ("" if last == step else
        (f"; the steps after it, replayed from their parameters at each up to step {last}, leave "
         + ("it alone" if len(fits) == 1 else "them") +
         (" (" + "; ".join(f"{name(id)} stops fitting at step {t}, {score:.3g} x" for id, (t, score) in
                           dropped.items()) + ")" if dropped else "")))
    if len(fits) == 1:
        id = next(iter(fits))
        hypothesis = adamw_replay.HYPOTHESES[id]
        return Diagnosis(f"{name(id)}: {started}, that variant of AdamW reproduces theirs "
                         f"({first_scores[id]:.2g} of the tolerance), and AdamW as the trace states it does not "
                         f"({true_score:.3g} x the tolerance){later}: {hypothesis['words']}", named=id), None
    ids = sorted(fits)
    separate = separation(ids, fits, step, last, len(ref.steps), rates, name)
    return Diagnosis(f"{len(ids)} mistakes of AdamW reproduce theirs, not told apart: {started}, "
                     + ", ".join(f"\"{name(id)}\" ({first_scores[id]:.2g} of the tolerance)" for id in ids)
                     + f", and AdamW as the trace states it does not ({true_score:.3g} x the tolerance){later}. "
                     + f"What would separate them: {separate}. "
                     + "; ".join(f"{name(id)}: {adamw_replay.HYPOTHESES[id]['words']}" for id in ids),
                     fits=ids, separate=separate), None


def separation(ids, fits, step, last, steps, rates, name):
    """What would tell the hypotheses that still fit apart: where they change the rate alone, the first step
    whose rates differ; else the steps after the last one read."""
    rate_only = all(set(k for k, v in fits[id][1].variant.items() if adamw_replay.TRUE[k] != v)
                    <= {"lr_shift", "warmup_from_zero", "lr_factor", "no_update"} for id in ids)
    names = " and ".join(name(id) for id in ids)
    if rate_only:
        def rate(id, t):
            replay = fits[id][1]
            if replay.variant["no_update"]:
                return 0.0
            return replay.lr(t) if 1 <= t + replay.variant["lr_shift"] <= steps else math.nan
        same = rate(ids[0], step)
        warmup = " (linear warmup: step 2's rate is twice step 1's)" if step == 1 and steps > 1 and \
            ratio_is(rates[1], 2 * rates[0], 1e-6) else ""
        for t in range(last + 1, steps + 1):
            values = [rate(id, t) for id in ids]
            if any(not math.isfinite(v) for v in values) or \
                    max(values) - min(values) > 1e-6 * max(abs(v) for v in values):
                return (f"{names} give the same rate at step {step} ({same:.4g}){warmup}: they differ at step {t}; "
                        f"keep step {t} (--trace-params-every 1)")
        return f"{names} give the same rate at every step of this run; a run with another schedule would differ"
    if last < steps:
        return (f"{names} reproduce step {step}" + (f" through step {last}" if last > step else "") +
                f": the steps after (the state m and v each carries) differ; keep step {last + 1} on "
                f"(--trace-params-every 1)")
    return f"{names} reproduce every kept step of this run; a run with other settings (clip, weight decay, eps) would"
