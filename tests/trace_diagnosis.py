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


# ----------------------------------------------------------------------------
# Diagnoses: what pattern of difference points to which bug

def diagnose_lr(pair, step, theirs, mine):
    steps = pair.ref.steps
    for shift in (-1, 1):
        other = step + shift
        if 1 <= other <= len(steps) and same_setting(steps[other - 1]["lr"], theirs):
            return (f"theirs is zero2's rate of step {other}: the schedule is shifted by one step (DeepSpeed's "
                    f"schedulers start at iteration -1 and run step t at iteration t - 2; the trace's steps[].lr is "
                    f"the rate of each step's update)")
    return ("the learning rate differs: set each step's rate from the trace's steps[].lr (or, with a DeepSpeed config, "
            "let DeepSpeed's scheduler set it and compare)")


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
            return ("theirs is the mean of the ranks' own means (each rank averaging over its own selected positions, "
                    "as Hugging Face's loss does), not the mean over the selected positions of the whole global batch: "
                    f"the ranks select {[c for _, c in ranks]} positions, so their means weigh differently. Sum each "
                    "rank's cross-entropy and divide by the global batch's count (times N where DDP averages)")
        if pair.A > 1 and distinct(per_micro_batch) and abs(theirs - per_micro_batch) <= tolerance:
            return ("theirs is the mean of the micro-batches' own means, not the mean over the whole global batch's "
                    "selected positions: accumulate summed cross-entropy and divide once by the global count")
        if abs(theirs - mine * total) <= tolerance * total:
            return "theirs is the summed cross-entropy, not its mean over the global batch's selected positions"
    named = loss_factor_diagnosis(pair, theirs, mine, tolerance, gradients_agree)
    if named:
        return named
    if step == 1 and generic:
        return ("from the same weights and the same batch the loss differs, so the forward pass or the loss does: "
                "the model (BertForMaskedLM: GELU in its erf form, LayerNorm eps 1e-12, one token type, no attention "
                "mask), the batch's rows (micro-batch m = a N + r), labels -100 not selected")
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
        if abs(theirs - mine * factor) <= tolerance * factor:
            return (f"theirs is {theirs / mine:.4f} x zero2's = {which}{both}: the loss is scaled by the {how}: "
                    f"summed over them where zero2 records the mean over the whole global batch{recorded}")
        if abs(theirs * factor - mine) <= tolerance:
            by_ranks = ("each rank's part was divided by N again, after the mean over the global batch counted "
                        "every rank")
            by_steps = ("each micro-batch's loss was divided by the A micro-steps (as Hugging Face's Trainer divides "
                        "by gradient_accumulation_steps) on top of the mean over the global batch, which already "
                        "counts every micro-step's positions")
            words = by_steps if which == "A" else by_ranks if A != N else f"{by_ranks}; or (A) {by_steps}"
            return (f"theirs is {theirs / mine:.4f} x zero2's = 1 / {which}{both}: the loss is scaled by the {how}: "
                    f"{words}{recorded}")
    return None


def factor_diagnosis(pair, ratio):
    """A gradient N or A times zero2's (or 1 / that): what was summed where it is averaged, or averaged twice.
    A factor of N names the ranks, of A the micro-steps; where N = A either may be it."""
    N, A = pair.N, pair.A
    factors = [(N, "N", f"the {N} ranks")] * (N > 1) + [(A, "A", f"the {A} micro-steps")] * (A > 1 and A != N) \
        + [(N * A, "N A", f"both the {N} ranks and the {A} micro-steps")] * (N > 1 and A > 1)
    for factor, which, over in factors:
        both = " (or A: N = A here)" if which == "N" and A == N else ""
        if ratio_is(ratio, factor):
            return (f"theirs is {ratio:.4f} x zero2's = {which}{both}: the gradients were summed over {over}, not "
                    f"averaged (the reduction sums: divide by {which}, or scale each rank's loss as the trace's "
                    f"conventions.loss says)")
        if ratio_is(ratio, 1 / factor):
            return (f"theirs is {ratio:.4f} x zero2's = 1 / {which}{both}: the gradients were averaged over {over} "
                    f"twice (the loss already carries 1 / {which}, or the reduction divides after DDP did)")
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
        return (f"theirs is {ratio:.6g} x zero2's = the step's loss scale {scale:g}: the norm was taken of the "
                f"gradient still carrying the loss scale, so the clip coefficient is off by it too (divide the "
                f"scale out before the norm and the clip, as DeepSpeed's unscale_and_clip_grads does)")
    if gradients_agree:
        for factor, which in ((N, "N"), (A, "A")):
            if factor <= 1 or (which == "A" and A == N):
                continue
            if ratio_is(ratio, factor) or ratio_is(ratio, 1 / factor):
                both = f" (or {'A' if which == 'N' else 'N'}: N = A here)" if N == A else ""
                when = "before dividing by" if ratio > 1 else "after dividing twice by"
                return (f"the gradients of this step agree with zero2's, but the norm is {ratio:.4f} x zero2's = "
                        f"{'' if ratio > 1 else '1 / '}{which}{both}: the norm was computed {when} {which}, of the "
                        f"summed gradient and not the averaged one that the step uses (compute the norm, and the "
                        f"clip coefficient from it, after the reduction's average)")
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
                return (f"theirs is the norm of rank {r}'s own shard alone ({math.sqrt(sum_squares):.6g}; the whole "
                        f"gradient's is {mine:.6g}): in ZeRO-2 each rank holds only its shard of the reduced gradient, "
                        f"so the squares must be summed over all ranks (an all-reduce) before the square root")
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
            return (f"the shards of rank(s) {stale_ranks} (every bucket) still hold their values from before this "
                    f"step, rank(s) {fresh_ranks}'s are updated: the all-gather ran before the update (or gathered "
                    f"the buffer from before it, or its result was not copied back), so the rank whose copy this "
                    f"is sees only its own shard's update")
        return (f"the shards of rank(s) {stale_ranks} (every bucket) still hold their values from before this "
                f"step, rank(s) {fresh_ranks}'s are updated: rank(s) {stale_ranks} sent their shards from before "
                f"the update to the all-gather (or did not step)")
    if not set(stale_buckets) & set(fresh_buckets):  # whole buckets: every rank's shard of a bucket alike
        names = [n for n, p in pair.params.items() if p["bucket"] in stale_buckets]
        return (f"bucket(s) {stale_buckets} ({names[0]}, ...) still hold their values from before this step on "
                f"every rank, the other buckets are updated: those parameters were left out of the update (a "
                f"parameter group missing from the optimizer, or a bucket whose reduction never completed)")
    return None


def diagnose_parameters(pair, step, theirs, mine, before, shards, lr, weight_decay, tolerance):
    """theirs, mine: {name: values after `step`}; before: zero2's after step - 1 (the initial weights at 1);
    shards: their ShardUpdates (whole ranks' or buckets' stale shards were judged before, diagnose_stale_shards)."""
    # A whole update missing.
    shards_theirs, shards_mine, shards_before = shards.theirs, shards.mine, shards.before
    if shards.stale and not shards.fresh and not shards.other:
        return ("every parameter still holds its value from before this step: the update never reached the weights "
                "(the optimizer stepped a copy, or the all-gather sent the parameters from before the update)")
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
                return (f"rank {r}'s shard of bucket {b} holds what zero2 has in rank {neighbour[1]}'s shard: a shard "
                        f"offset off by one rank (shard r starts at bucket offset + r x shard_length; the all-to-all "
                        f"sends slice j to rank j and the all-gather puts rank j's shard back at slice j)")
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
            return (f"the tensors that differ are exactly those without weight decay (biases, LayerNorm: {off[0]}, ...), "
                    f"each by -lr x wd x p: weight decay was applied to them; leave the biases and LayerNorm weights "
                    f"out of AdamW's decay (the trace's optimizer.no_weight_decay)")
        if off and all(n not in pair.no_decay for n in off) and explained_by_decay(off, 1):
            return (f"the tensors that differ are exactly those with weight decay ({off[0]}, ...), each by +lr x wd x p: "
                    f"theirs applied no weight decay")
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
            return (f"theirs moved every parameter {ratio:.3f} x as far as zero2 = (1 - beta1^t) / sqrt(1 - beta2^t) at "
                    f"t = {t}: AdamW without its bias corrections (m / (1 - beta1^t), v / (1 - beta2^t))")
        if abs(ratio - 1) > 0.05 and np.std(updates_theirs[moving] / updates_mine[moving]) < 0.05 * abs(ratio):
            return (f"theirs moved every parameter {ratio:.3f} x as far as zero2: the learning rate or the update's "
                    f"scale differs")
    return None


# ----------------------------------------------------------------------------
# Replaying the failing step: AdamW and its common mistakes (tests/peers/adamw_replay.py)
#
# A pattern (a ratio, a set of tensors) points to a bug; a replay shows it. From the parameters before the
# failing step, the state (m, v) before it and the step's gradient, AdamW as the trace states it, and each
# variant of the catalogue, computes the parameters after the step; a variant that lands on theirs within one
# step's tolerance, where the true formula does not, names the bug. The state is recomputed from step 1 by
# each variant's own formula (betas swapped change m and v, not step 1's update: AdamW's first step is
# sign(g) whatever the betas), so the replay needs every step's gradient up to the failing one, theirs where
# kept (the one their optimizer read), else zero2's, and the parameters before it: a trace made with
# --trace-params-every 1, replayed by a peer that keeps what the trace keeps.

def replay_step(pair, step):
    """(named, measured). named: the diagnosis when a variant reproduces theirs after `step` and the true
    formula does not; else None, and measured says what the replay found (or why it could not run)."""
    if pair.precision != "fp32":
        return None, None  # mixed precision's step reads 16-bit gradients and a loss scale: not replayed
    ref, theirs = pair.ref, pair.theirs
    sources = []
    for t in range(1, step + 1):
        side = "theirs" if theirs.parameter_steps.get(t) else "ref" if ref.parameter_steps.get(t) else None
        before = ("ref" if t == 1 else "theirs" if (t - 1) in theirs.parameter_steps
                  else "ref" if (t - 1) in ref.parameter_steps else None)
        if side is None or before is None:
            return None, (f"The replay of AdamW's step (and its common mistakes) needs the gradient of every step "
                          f"1 .. {step} and the parameters before each: step {t}'s "
                          f"{'gradient' if side is None else 'parameters before it'} is kept by neither trace "
                          f"(make zero2's trace with --trace-params-every 1)")
        sources.append((side, before))

    def read(side, kind, t):  # not cached in pair: a long replay would hold every step's tensors
        cached = (side, kind, t) in pair._read
        values = pair.tensors(side, kind, t)
        if not cached:
            del pair._read[(side, kind, t)]
        return values

    flat = adamw_replay.Flat(pair.layout, pair.no_decay, pair.N)
    rates = [record["lr"] for record in ref.steps]
    betas = [record["betas"] for record in ref.steps] if all("betas" in r for r in ref.steps) else None
    replays = [("AdamW as the trace states it", adamw_replay.Replay(flat, ref.optimizer, rates, {}, betas), "")]
    replays += [(name, adamw_replay.Replay(flat, ref.optimizer, rates, changes, betas), words)
                for name, changes, words in adamw_replay.CATALOGUE]
    replays = [entry for entry in replays if entry[1].applies(step)]
    for t, (side, before_side) in enumerate(sources, start=1):
        gradient = flat.flat(read(side, "gradients", t))
        before = flat.flat(read(before_side, "parameters", t - 1))
        norm = (theirs if side == "theirs" else ref).steps[t - 1]["grad_norm"]
        results = [replay.step(t, before, gradient, norm) for _, replay, _ in replays]
    # One update's tolerance where the replay starts from theirs' own parameters (it then differs from theirs
    # by one update's rounding), the checker's, summed over the steps, where it starts from zero2's.
    own_start = step == 1 or sources[-1][1] == "theirs"
    lrs = [rates[step - 1]] if own_start else rates[:step]
    median_tolerance, largest_tolerance = parameter_tolerances(sum(lrs), "fp32")
    target = pair.tensors("theirs", "parameters", step)

    def excess(result, against):  # the checker's measure: the worst tensor's median or largest, over tolerance
        worst = 0.0
        for name, values in flat.tensors(result).items():
            difference = np.abs(values.astype(np.float64) - np.asarray(against[name], np.float64).reshape(-1))
            median = 0.0 if name in pair.noise else float(np.median(difference))
            worst = max(worst, share(median, median_tolerance), share(float(difference.max(initial=0.0)),
                                                                       largest_tolerance))
        return worst

    true = excess(results[0], target)
    true_tensors = flat.tensors(results[0])
    scored = [(excess(result, target), name, words) for (name, _, words), result in zip(replays[1:], results[1:])
              if excess(result, true_tensors) > 1]  # a variant that equals the true step here tells nothing
    whose = {s for s, _ in sources}
    origin = ("the initial weights" if step == 1 else
              ("their" if own_start else "zero2's") + f" parameters after step {step - 1}")
    gradients = ("theirs" if whose == {"theirs"} else "zero2's" if whose == {"ref"} else
                 "theirs where kept, else zero2's")
    started = (f"replaying step {step} from {origin}, with AdamW's state recomputed from the gradients of steps "
               f"1 .. {step} ({gradients})")
    if true <= 1:
        return None, (f"The replay reproduces theirs with AdamW as the trace states it ({started}: {true:.2g} of "
                      f"the tolerance): the update itself is right; what differs came in with its inputs")
    fits = sorted(entry for entry in scored if entry[0] <= 1)
    if fits:
        score, name, words = fits[0]
        also = "" if len(fits) == 1 else f" (so do, within the tolerance: {', '.join(n for _, n, _ in fits[1:])})"
        return (f"{name}: {started}, that variant of AdamW reproduces theirs ({score:.2g} of the tolerance){also}, "
                f"and AdamW as the trace states it does not ({true:.3g} x the tolerance): {words}"), None
    nearest = min(scored) if scored else None
    return None, (f"The replay named no mistake of AdamW: {started}, AdamW as the trace states it is {true:.3g} x "
                  f"the tolerance from theirs" + (f", and the nearest of {len(scored)} variants "
                                                    f"(tests/peers/adamw_replay.py), \"{nearest[1]}\", "
                                                    f"{nearest[0]:.3g} x"
                                                    if nearest else ""))
