#!/usr/bin/python3
"""tests/check_trace.py: another implementation's trace checked against zero2's (notes/12).

    /usr/bin/python3 tests/check_trace.py REF THEIRS [--every-step]   (make check-trace REF=... THEIRS=...)

REF is zero2's trace (train_bert_mini --trace DIR); THEIRS the trace a peer wrote replaying it, in the same
format (tests/peers/trace_files.py; tests/peers/torch_peer.py is a template). Step by step it compares the
learning rate, the loss and the gradient norm, and at the steps both keep, the gradients and the parameters,
each against a tolerance it prints and notes/12 justifies. It stops at the first step and tensor outside the
tolerance, says where the differing elements lie in ZeRO's terms (which parameter, which bucket, which rank's
shard at the trace's N) and what bug that pattern points to, from what it measured (a ratio of N, a norm that
equals one rank's shard's, a difference that is -lr wd p on exactly the tensors without weight decay, ...).

Exit status 0: theirs agrees at every step; 1: it does not (the first failure and its diagnosis are printed);
2: a trace cannot be read or the two contradict each other (one message naming the file and the field).
The last line is "N passed, M failed": one check per step and one per kept step's tensors.
Numpy and the standard library only (Debian's /usr/bin/python3).
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from trace_files import Trace, TraceError  # noqa: E402


class BadInput(Exception):
    """Two traces that cannot be compared: exit 2 with this message."""


class Failure(Exception):
    """The first disagreement: what differs, and the diagnosis."""

    def __init__(self, what, diagnosis, excess=None):
        super().__init__(what)
        self.what, self.diagnosis, self.excess = what, diagnosis, excess  # excess: difference / tolerance


# ----------------------------------------------------------------------------
# Tolerances (notes/12, "Tolerances"). An implementation that computes the same functions in another order
# differs from zero2 by rounding alone: from the same weights and batch (step 1) by a few units in the last
# place of the loss and the norm; later by more, because the parameters carry step 1's rounding forward.
# Every bug this checker names moves something by orders of magnitude more (measured: notes/12's table).

UNIT = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -7, "fp16": 2.0 ** -10}  # the spacing of the numbers in [1, 2)


def ulp(value, precision):
    """The spacing of `precision`'s numbers at |value|."""
    return UNIT[precision] * 2.0 ** math.floor(math.log2(abs(value))) if value != 0 else UNIT[precision]


def loss_tolerance(loss, step, precision):
    return (4 + step) * ulp(loss, precision)


def norm_tolerance(norm, step, precision):
    return (8 + 2 * step) * ulp(norm, precision)


def gradient_tolerance(largest, step, precision):
    """Per element, against the model's largest gradient element: each gradient is a sum of many products,
    rounded in another order, and later computed from parameters that differ by rounding."""
    return 1e-5 * (1 + step) * largest * UNIT[precision] / UNIT["fp32"]


def parameter_tolerances(lr_sum, precision):
    """(median, largest) of |theirs - zero2| per tensor, lr_sum the rates summed over the steps so far. AdamW
    moves an element by about lr a step whatever its gradient's size, so an element whose gradient is near
    zero, where rounding decides its sign, may move the other way in another implementation: a few elements
    differ by up to ~2 lr a step. The median catches a tensor that is off as a whole; the largest, an element
    that moved further than AdamW can move it."""
    scale = UNIT[precision] / UNIT["fp32"]
    return 1e-4 * lr_sum * scale, 2.5 * lr_sum


# ----------------------------------------------------------------------------
# The two traces side by side

class Pair:
    def __init__(self, ref, theirs):
        self.ref, self.theirs = ref, theirs
        self.precision = ref.run["precision"]
        self.N = ref.run["world_size"]
        self.A = ref.run["accumulation_steps"]
        self.layout = ref.layout
        if self.layout is None:
            raise BadInput(f"{ref.path}: no field layout: REF must be zero2's own trace (train_bert_mini --trace)")
        self.params = {p["name"]: p for p in self.layout["parameters"]}
        self.no_decay = set(ref.optimizer["no_weight_decay"])
        self.noise = self.noise_tensors()

    def noise_tensors(self):
        """The tensors whose gradient is rounding noise in zero2's trace (every element below 1e-7 of the
        model's largest, at every kept step): an attention key's bias, which softmax ignores (a constant added
        to a row of scores), has a gradient that is exactly 0 in exact arithmetic. AdamW turns noise into
        steps of about lr in a direction rounding decides, in zero2 and in any other implementation, so these
        tensors are held only to AdamW's bound (the largest tolerance), not to the median."""
        noise = None
        for step in self.ref.parameter_steps:
            gradients = self.ref.gradients(step)
            if gradients is None:
                continue
            largest = max(float(np.abs(g).max()) for g in gradients.values())
            if not math.isfinite(largest):
                continue  # an fp16 step that overflowed: its gradient says nothing of noise
            quiet = {n for n, g in gradients.items() if float(np.abs(g).max()) <= 1e-7 * largest}
            noise = quiet if noise is None else noise & quiet
        return noise or set()

    def check_settings(self):
        """The two must describe one run: the model, the batch and the optimizer theirs used."""
        if self.ref.run.get("dropout", 0) != 0:
            raise BadInput(f"{self.ref.path}: run.dropout is {self.ref.run['dropout']}: zero2's dropout masks come "
                           f"from its own hash, which no other implementation draws; trace a run with --dropout 0")
        for section, keys in (("model", ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size", "max_position_embeddings")),
                              ("run", ("world_size", "accumulation_steps", "micro_batch", "seq", "precision")),
                              ("optimizer", ("betas", "eps", "weight_decay", "bias_correction", "clip"))):
            for key in keys:
                mine = self.ref.field(section, key)
                try:
                    theirs = self.theirs.json[section][key]
                except (KeyError, TypeError):
                    continue  # a peer need not repeat every setting
                if not same_setting(mine, theirs):
                    raise BadInput(f"{self.theirs.path}: {section}.{key} is {theirs!r}, zero2's trace has {mine!r}: "
                                   f"not a replay of this run")
        theirs_no_decay = self.theirs.json.get("optimizer", {}).get("no_weight_decay")
        if theirs_no_decay is not None and set(theirs_no_decay) != self.no_decay:
            raise BadInput(f"{self.theirs.path}: optimizer.no_weight_decay names other tensors than zero2's trace "
                           f"({sorted(set(theirs_no_decay) ^ self.no_decay)[:3]} ...)")
        if len(self.theirs.steps) < len(self.ref.steps):
            raise BadInput(f"{self.theirs.path}: steps has {len(self.theirs.steps)} records, zero2's trace "
                           f"{len(self.ref.steps)}: step {len(self.theirs.steps) + 1} is missing")
        for k, record in enumerate(self.theirs.steps[:len(self.ref.steps)]):
            for key in ("loss", "grad_norm", "lr"):
                if key not in record:
                    raise BadInput(f"{self.theirs.path}: steps[{k}].{key} is missing (step {k + 1})")
                if record[key] is not None and not isinstance(record[key], (int, float)):
                    raise BadInput(f"{self.theirs.path}: steps[{k}].{key} is {record[key]!r}, not a number")

    # --- ZeRO's terms: where a flat element lies ----------------------------------------------------------

    def where(self, name, index):
        """'parameter[i] (bucket b, rank r's shard at N)' of element `index` of parameter `name`."""
        p = self.params[name]
        flat = p["offset"] + int(index)
        bucket = self.layout["buckets"][p["bucket"]]
        rank = (flat - bucket["offset"]) // bucket["shard_length"]
        return f"{name}[{np.unravel_index(int(index), p['shape']) if len(p['shape']) > 1 else int(index)}] " \
               f"(bucket {p['bucket']}, rank {rank}'s shard at N = {self.N})"

    def shard_views(self, values):
        """{(bucket, rank): flat values of that shard} of named tensors laid out as zero2 does at N."""
        flat = np.zeros(self.layout["psi_padded"], dtype=np.float64)
        for name, p in self.params.items():
            flat[p["offset"]:p["offset"] + p["numel"]] = np.asarray(values[name], dtype=np.float64).reshape(-1)
        shards = {}
        for b, bucket in enumerate(self.layout["buckets"]):
            for r in range(self.N):
                begin = bucket["offset"] + r * bucket["shard_length"]
                shards[(b, r)] = flat[begin:begin + bucket["shard_length"]]  # padding is zero on both sides
        return shards


def same_setting(mine, theirs):
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        return len(mine) == len(theirs) and all(same_setting(a, b) for a, b in zip(mine, theirs))
    if isinstance(mine, bool) or isinstance(theirs, bool) or isinstance(mine, str):
        return mine == theirs
    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)):
        return abs(mine - theirs) <= 1e-6 * max(abs(mine), abs(theirs), 1e-30)
    return mine == theirs


def share(difference, tolerance):
    """difference / tolerance; a tolerance of 0 (no rate yet: DeepSpeed's first step runs at warmup_min_lr,
    often 0, so the parameters must not move at all) admits no difference."""
    return difference / tolerance if tolerance > 0 else (0.0 if difference == 0 else math.inf)


def ratio_is(ratio, value, slack=1e-3):
    return value != 0 and abs(ratio / value - 1) <= slack


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


def diagnose_loss(pair, step, theirs, mine):
    record = pair.ref.steps[step - 1]
    losses, selected = record.get("micro_batch_losses"), record.get("micro_batch_selected")
    tolerance = 8 * loss_tolerance(mine, step, pair.precision)
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
        if N > 1 and (abs(theirs - mine * N) <= tolerance * N or abs(theirs * N - mine) <= tolerance):
            return f"theirs is {theirs / mine:.4f} x zero2's (N = {N}): the loss is scaled by the number of ranks"
    if step == 1:
        return ("from the same weights and the same batch the loss differs, so the forward pass or the loss does: "
                "the model (BertForMaskedLM: GELU in its erf form, LayerNorm eps 1e-12, one token type, no attention "
                "mask), the batch's rows (micro-batch m = a N + r), labels -100 not selected")
    return None


def factor_diagnosis(pair, ratio):
    """A gradient N or A times zero2's (or 1 / that): what was summed where it is averaged, or averaged twice.
    A factor of N names the ranks, of A the micro-steps; where N = A either may be it."""
    N, A = pair.N, pair.A
    factors = [(N, "N", f"the {N} ranks")] * (N > 1) + [(A, "A", f"the {A} micro-steps")] * (A > 1 and A != N)
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


def diagnose_norm(pair, step, theirs, mine):
    N = pair.N
    if not mine:
        return None
    ratio = theirs / mine
    named = factor_diagnosis(pair, ratio)
    if named:
        return named
    gradients = pair.ref.gradients(step)
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


def diagnose_parameters(pair, step, theirs, mine, before, lr, weight_decay, tolerance):
    """theirs, mine: {name: values after `step`}; before: zero2's after step - 1 (the initial weights at 1)."""
    # A whole update missing, or whole shards holding the values from before the update.
    shards_theirs, shards_mine, shards_before = (pair.shard_views(v) for v in (theirs, mine, before))
    fresh, stale, other = [], [], []
    for key, values in shards_theirs.items():
        if close_to(values, shards_mine[key], tolerance):
            fresh.append(key)
        elif close_to(values, shards_before[key], tolerance):
            stale.append(key)
        else:
            other.append(key)
    if stale and not fresh and not other:
        return ("every parameter still holds its value from before this step: the update never reached the weights "
                "(the optimizer stepped a copy, or the all-gather sent the parameters from before the update)")
    if stale and fresh:
        stale_ranks, fresh_ranks = sorted({r for _, r in stale}), sorted({r for _, r in fresh})
        stale_buckets, fresh_buckets = sorted({b for b, _ in stale}), sorted({b for b, _ in fresh})
        if not set(stale_ranks) & set(fresh_ranks):  # whole ranks: every bucket's shard of a rank alike
            return (f"the shards of rank(s) {stale_ranks} (every bucket) still hold their values from before this "
                    f"step, rank(s) {fresh_ranks}'s are updated: the all-gather ran before the update (or gathered "
                    f"the buffer from before it), so each rank sees only its own shard's update")
        if not set(stale_buckets) & set(fresh_buckets):  # whole buckets: every rank's shard of a bucket alike
            names = [n for n, p in pair.params.items() if p["bucket"] in stale_buckets]
            return (f"bucket(s) {stale_buckets} ({names[0]}, ...) still hold their values from before this step on "
                    f"every rank, the other buckets are updated: those parameters were left out of the update (a "
                    f"parameter group missing from the optimizer, or a bucket whose reduction never completed)")
    # A shard holding the neighbouring shard's values.
    for key in other:
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
# The walk through the steps

def check_step_scalars(pair, step, report):
    mine, theirs = pair.ref.steps[step - 1], pair.theirs.steps[step - 1]
    precision = pair.precision
    if not same_setting(mine["lr"], theirs["lr"]):
        raise Failure(f"step {step}, learning rate: theirs {theirs['lr']!r}, zero2's {mine['lr']!r}",
                      diagnose_lr(pair, step, theirs["lr"], mine["lr"]))
    if mine.get("skipped") or theirs.get("skipped"):
        if bool(mine.get("skipped")) != bool(theirs.get("skipped")):
            scales = (mine.get("loss_scale"), theirs.get("loss_scale"))
            raise Failure(f"step {step}: {'zero2' if mine.get('skipped') else 'theirs'} skipped it (an fp16 overflow), "
                          f"the other did not (loss scales: zero2's {scales[0]}, theirs {scales[1]})",
                          "the loss scales differ: compare steps[].loss_scale from step 1 on"
                          if not same_setting(*scales) else
                          "at the same loss scale one side's gradient overflowed and the other's did not: a sum of "
                          "the ranks' scaled 16-bit gradients before dividing by N overflows where each rank's "
                          "part does not (zero2 sums the 16-bit slices in fp32 and rounds once)")
        report.append((step, "skipped by both (fp16 overflow)", 0.0))
        return
    for key, tolerance_of, diagnose in (("loss", loss_tolerance, diagnose_loss),
                                        ("grad_norm", norm_tolerance, diagnose_norm)):
        if mine[key] is None or not math.isfinite(mine[key]):
            raise BadInput(f"{pair.ref.path}: steps[{step - 1}].{key} is {mine[key]} on a step zero2 did not skip: "
                           f"the reference diverged there; trace a run that trains")
        value = theirs[key]
        if value is None or not math.isfinite(value):
            raise Failure(f"step {step}, {key}: theirs is {value} ({pair.theirs.path}: steps[{step - 1}].{key}), "
                          f"zero2's {mine[key]!r}", "theirs diverged: the first non-finite value is here")
        tolerance = tolerance_of(mine[key], step, precision)
        if abs(value - mine[key]) > tolerance:
            raise Failure(f"step {step}, {key.replace('_', ' ')}: theirs {value:.9g}, zero2's {mine[key]:.9g} "
                          f"(|difference| {abs(value - mine[key]):.3g} > tolerance {tolerance:.3g})",
                          diagnose(pair, step, value, mine[key]), share(abs(value - mine[key]), tolerance))
    relative = {key: abs(theirs[key] - mine[key]) / abs(mine[key]) if mine[key] else 0.0 for key in ("loss", "grad_norm")}
    report.append((step, f"loss {mine['loss']:.7f} / {theirs['loss']:.7f} (relative {relative['loss']:.1e}), "
                         f"grad norm {mine['grad_norm']:.6g} / {theirs['grad_norm']:.6g} "
                         f"(relative {relative['grad_norm']:.1e}), lr {mine['lr']:.4g}",
                   max(abs(theirs["loss"] - mine["loss"]) / loss_tolerance(mine["loss"], step, precision),
                       abs(theirs["grad_norm"] - mine["grad_norm"]) / norm_tolerance(mine["grad_norm"], step, precision))))


def read_tensors(trace, step, kind):
    values = trace.parameters(step) if kind == "parameters" else trace.gradients(step)
    return values


def same_tensors(pair, tensors, path):
    """Every parameter of zero2's layout in `tensors` with its shape, or a BadInput naming the first that is not."""
    for name, p in pair.params.items():
        if name not in tensors:
            raise BadInput(f"{path}: no tensor {name}")
        if list(tensors[name].shape) != p["shape"]:
            raise BadInput(f"{path}: {name} has {list(tensors[name].shape)}, zero2's {p['shape']}")


def check_gradients(pair, step):
    mine, theirs = pair.ref.gradients(step), pair.theirs.gradients(step)
    if mine is None or theirs is None or pair.ref.steps[step - 1].get("skipped"):
        return None  # not kept on one side, or an fp16 overflow (zero2's gradient is not finite there)
    same_tensors(pair, theirs, f"{pair.theirs.directory}/step_{step}/gradients.safetensors")
    largest = max(float(np.abs(v).max()) for v in mine.values())
    tolerance = gradient_tolerance(largest, step, pair.precision)
    worst, largest_difference = 0.0, 0.0
    for name, p in pair.params.items():  # registration order: the first tensor that differs is named
        a, b = np.asarray(mine[name], np.float64).reshape(-1), np.asarray(theirs[name], np.float64).reshape(-1)
        difference = np.abs(a - b)
        worst = max(worst, share(float(difference.max()), tolerance))
        largest_difference = max(largest_difference, float(difference.max()))
        if difference.max() > tolerance:
            i = int(difference.argmax())
            ratio = float(np.median(b[a != 0] / a[a != 0])) if (a != 0).any() else math.nan
            diagnosis = None
            if not math.isnan(ratio) and not ratio_is(ratio, 1, 1e-3):
                diagnosis = factor_diagnosis(pair, ratio)  # a factor the whole tensor shares
            raise Failure(f"step {step}, gradient of {pair.where(name, i)}: theirs {b[i]:.6g}, zero2's {a[i]:.6g} "
                          f"(|difference| {difference[i]:.3g} > tolerance {tolerance:.3g}, 1e-5 (1 + s) of the "
                          f"largest gradient element)", diagnosis or
                          f"the gradient of {name} differs first (registration order): its forward or backward",
                          share(float(difference.max()), tolerance))
    return worst, largest_difference / largest


def check_parameters(pair, step, previous):
    mine, theirs = pair.ref.parameters(step), pair.theirs.parameters(step)
    before = pair.ref.parameters(previous)
    lr_sum = sum(pair.ref.steps[t - 1]["lr"] for t in range(1, step + 1))
    update_median, update_largest = parameter_tolerances(lr_sum, pair.precision)
    same_tensors(pair, theirs, f"{pair.theirs.directory}/step_{step}/model.safetensors")
    worst = 0.0
    for name, p in pair.params.items():
        # In mixed precision one unit of the format more, at the tensor's size: a peer's fp32 master may start
        # from its 16-bit model (DeepSpeed's does), zero2's starts from the fp32 weights themselves.
        size = np.abs(np.asarray(mine[name], np.float64))
        start = UNIT[pair.precision] if pair.precision != "fp32" else 0.0
        median_tolerance = update_median + start * float(np.median(size))
        largest_tolerance = update_largest + start * float(size.max())
        difference = np.abs(np.asarray(theirs[name], np.float64) - mine[name]).reshape(-1)
        median, largest = float(np.median(difference)), float(difference.max())
        if name in pair.noise:
            median = 0.0  # held to AdamW's bound alone (Pair.noise_tensors)
        worst = max(worst, share(median, median_tolerance), share(largest, largest_tolerance))
        if median > median_tolerance or largest > largest_tolerance:
            i = int(difference.argmax())
            lr = pair.ref.steps[step - 1]["lr"]
            diagnosis = diagnose_parameters(pair, step, theirs, mine, before, lr,
                                            pair.ref.optimizer["weight_decay"], median_tolerance) \
                if previous == step - 1 else None
            raise Failure(f"parameters after step {step}, {pair.where(name, i)}: theirs "
                          f"{np.asarray(theirs[name]).reshape(-1)[i]:.9g}, zero2's {mine[name].reshape(-1)[i]:.9g}; "
                          f"over {name}: median |difference| {median:.3g} (tolerance {median_tolerance:.3g}), largest "
                          f"{largest:.3g} (tolerance {largest_tolerance:.3g})",
                          diagnosis or (f"{name} is the first tensor (registration order) outside the tolerance"
                                        + ("" if previous == step - 1 else
                                           f"; the traces keep no parameters between steps {previous} and {step}: "
                                           f"keep every step's (--trace-params-every 1) to see the first update "
                                           f"that differs")),
                          max(share(median, median_tolerance), share(largest, largest_tolerance)))
    return worst


def check(pair, counts):
    """Every step in order, counting the checks passed in counts["passed"]; the first failure raised.
    Returns the report's lines."""
    report = []
    kept = sorted(s for s in pair.ref.parameter_steps if s in pair.theirs.parameter_steps)
    previous_kept = 0
    for step in range(1, len(pair.ref.steps) + 1):
        check_step_scalars(pair, step, report)
        counts["passed"] += 1
        if step in kept:
            gradients = check_gradients(pair, step)
            worst_parameter = check_parameters(pair, step, previous_kept)
            report.append((step, f"after step {step}: {len(pair.params)} tensors: parameters"
                                 + ("" if gradients is None else
                                    f" and gradients (the largest difference {gradients[1]:.1e} of the largest "
                                    f"gradient)") + " within the tolerance",
                           max(worst_parameter, gradients[0] if gradients else 0.0)))
            previous_kept = step
            counts["passed"] += 1
    return report


def describe(trace):
    run = trace.run
    kept = ", ".join(str(s) for s in sorted(trace.parameter_steps))
    return (f"N = {run['world_size']}, A = {run['accumulation_steps']}, stage {run.get('stage', '?')}, "
            f"{run['precision']}, {len(trace.steps)} steps; parameters after steps {kept}")


def main(argv):
    every_step = "--every-step" in argv  # a line per step, not only the first, the last and the kept ones
    argv = [a for a in argv if a != "--every-step"]
    if len(argv) != 3 or argv[1].startswith("-"):
        print(__doc__.strip().split("\n\n")[1] if len(argv) > 1 else __doc__, file=sys.stderr)
        return 2
    try:
        ref, theirs = Trace(argv[1]), Trace(argv[2])
        pair = Pair(ref, theirs)
        pair.check_settings()
    except (TraceError, BadInput) as e:
        print(f"check_trace: error: {e}", file=sys.stderr)
        print("0 passed, 1 failed")
        return 2
    precision = pair.precision
    print(f"check_trace: {argv[2]} ({theirs.producer}) against zero2's {argv[1]} ({describe(ref)})")
    print(f"tolerances ({precision}; notes/12, \"Tolerances\"): loss (4 + s) ulp, grad norm (8 + 2 s) ulp; "
          f"gradients 1e-5 (1 + s) x the largest; parameters: median 1e-4 x, largest 2.5 x the lr summed over "
          f"steps 1 .. s" + ("" if precision == "fp32" else f", plus one {precision} unit of the tensor's size"))
    if pair.noise:
        print(f"held to the largest only (their gradient is rounding noise in zero2's trace): "
              f"{', '.join(sorted(pair.noise))}")
    counts = {"passed": 0}
    try:
        report = check(pair, counts)
    except BadInput as e:
        print(f"check_trace: error: {e}", file=sys.stderr)
        print("0 passed, 1 failed")
        return 2
    except TraceError as e:
        print(f"check_trace: error: {e}", file=sys.stderr)
        print("0 passed, 1 failed")
        return 2
    except Failure as failure:
        print(f"FAIL {failure.what}")
        if failure.excess is not None:
            print(f"margin: the difference is {failure.excess:.3g} x its tolerance")
        print(f"diagnosis: {failure.diagnosis or 'no known bug has this pattern; the difference is above'}")
        print(f"{counts['passed']} passed, 1 failed")
        return 1
    if not report:
        print("0 passed, 0 failed: zero2's trace has no steps")
        return 2
    worst = max(report, key=lambda line: line[2] if math.isfinite(line[2]) else 0.0)
    kept = sorted(s for s in ref.parameter_steps if s in theirs.parameter_steps)
    for step, line, fraction in report:
        if every_step or step == 1 or step == len(ref.steps) or "after step" in line:
            print(f"  step {step:4d}  {line}  ({fraction:.2f} of the tolerance)")
    if len(kept) < len(ref.parameter_steps):
        print(f"note: theirs keeps the parameters of {len(kept)} of zero2's {len(ref.parameter_steps)} kept steps; "
              f"only those were compared")
    print(f"PASS: theirs agrees with zero2 at all {len(ref.steps)} steps and {len(kept)} kept steps "
          f"(the closest call: step {worst[0]}, {worst[2]:.2f} of the tolerance)")
    print(f"{counts['passed']} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
