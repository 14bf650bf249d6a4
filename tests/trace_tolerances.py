"""tests/trace_tolerances.py: how far another implementation's trace may lie from zero2's, and the
comparisons of numbers and settings the checker makes with them (tests/check_trace.py; notes/12,
"Tolerances"). Imported by the checker and its diagnoses; nothing here reads a file.
"""
import math

import numpy as np


# ----------------------------------------------------------------------------
# Tolerances (notes/12, "Tolerances"). An implementation that computes the same functions in another order
# differs from zero2 by rounding alone: from the same weights and batch (step 1) by a few units in the last
# place of the loss and the norm; later by more, because the parameters carry step 1's rounding forward.
# Every bug this checker names moves something by orders of magnitude more (measured: notes/12's table).

UNIT = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -7, "fp16": 2.0 ** -10}  # the spacing of the numbers in [1, 2)


def ulp(value, precision):
    """The spacing of `precision`'s numbers at |value|."""
    return UNIT[precision] * 2.0 ** math.floor(math.log2(abs(value))) if value != 0 else UNIT[precision]


# The reductions. A sum of n terms in floating point is off by rounding that grows with n, and how fast
# depends on the order: one running total (each term added to the sum of all before it) is off by up to
# (n - 1) u of the sum of |terms| (u = 2^-24, half fp32's spacing in [1, 2)), and on terms of one sign it
# comes near that (measured: a running fp32 total of 3.4M squares, 3.2e4 ulp of their root); a sum in
# blocks of b (each block a running total, then the blocks' totals) is off by at most (b - 1 + n / b - 1) u,
# at best 2 (sqrt(n) - 1) u with blocks of sqrt(n). Every implementation this checks sums in blocks:
# vector lanes, one total per tensor (clip_grad_norm_), per bucket, per rank's shard, then the ranks'; so
# the tolerance admits the blocked bound, sqrt(n) and not n. In ulp of the result (ulp(v) > v u):
#   a sum of n non-negative terms (the loss's cross-entropies): 2 sqrt(n) ulp;
#   the root of one (the norm: the root halves a relative error and adds its own rounding): sqrt(n) ulp.
# The terms are fp32 in every precision (zero2, DeepSpeed and torch accumulate in fp32; a 16-bit total of
# millions of terms would be a bug of its own), so this part is counted in fp32's ulp, the rest in the
# run's precision. notes/12, "Tolerances", has the measurements: torch's norm at BERT-mini's size is 9.4
# ulp off, the bound there 1,850; the smallest norm bug (one rank's shard's norm) is 14% off, 10^3 x more.

def blocked_sum_ulps(terms):
    """The blocked sum's bound on the root of a sum of `terms` non-negative terms, in ulp of the root:
    sqrt(n); a plain sum's is twice that."""
    return math.sqrt(max(terms, 1))


def loss_tolerance(loss, step, precision, terms):
    """The loss: (4 + s) ulp of the precision (the forward's rounding, growing as the parameters carry each
    step's rounding forward) and the sum of the `terms` selected positions' cross-entropies."""
    return (4 + step) * ulp(loss, precision) + 2 * blocked_sum_ulps(terms) * ulp(loss, "fp32")


def norm_tolerance(norm, step, precision, terms):
    """The gradient norm: (8 + 2 s) ulp of the precision (the gradient's own rounding, which the norm
    carries) and the root of the sum of `terms` squares (every element of the gradient)."""
    return (8 + 2 * step) * ulp(norm, precision) + blocked_sum_ulps(terms) * ulp(norm, "fp32")


def gradient_tolerance(largest, step, precision, terms):
    """Per element, against the model's largest gradient element: each gradient is a sum of products over
    the global batch's `terms` positions, rounded in another order (the blocked bound, 2 sqrt(n) u of the
    largest), the products' own rounding (1e-5, measured at step 1), and later computed from parameters
    that differ by rounding (the factor 1 + s)."""
    return (1 + step) * largest * (1e-5 * UNIT[precision] / UNIT["fp32"] + 2 * blocked_sum_ulps(terms) * 2.0 ** -24)


def parameter_tolerances(lr_sum, precision):
    """(median, largest) of |theirs - zero2| per tensor, lr_sum the rates summed over the steps so far. AdamW
    moves an element by about lr a step whatever its gradient's size, so an element whose gradient is near
    zero, where rounding decides its sign, may move the other way in another implementation: a few elements
    differ by up to ~2 lr a step. The median catches a tensor that is off as a whole; the largest, an element
    that moved further than AdamW can move it.

    The median: AdamW's step lr m / sqrt(v) is the gradient's direction, so a gradient off by a relative e
    moves the step by about 2 e of lr (m and v each carry e), and the step's element differs by 2 e lr. In
    fp32, e is the summation order's (measured: 1e-4 of the rates summed covers it, notes/12); in 16-bit, the
    products and the gradient are rounded to the format, e = u (half its spacing), so 2 u lr a step, where
    every element's gradient is above its rounding. A tensor whose elements are partly rounding noise moves
    those by up to lr in either direction, which raises its median: measured, FSDP's bf16 replay at 0.0058 of
    the rates summed on the small model and 0.0144 at BERT-mini's default size (zero2 --portable 0.0002). So
    4 x the spacing, 2^-5 of the rates in bf16: 0.46 of it at the worst measured."""
    return max(1e-4, 4 * UNIT[precision]) * lr_sum, 2.5 * lr_sum


# Comparing numbers and settings

def is_number(value):
    """A JSON number (bool is a number to Python, not to a trace)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value):
    return is_number(value) and math.isfinite(value)


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
# Allowances from legitimate rounding: the twin (notes/12, "Allowances from legitimate rounding: the twin").
#
# The bounds above are worst cases written down once; how far a correct implementation really lands from zero2
# depends on the run: its size, its precision, and above all how far the training itself amplifies rounding
# (a long run's parameters carry every earlier step's rounding, and how fast that grows is the run's, not a
# formula's). So the checker measures it: beside zero2's trace, a second zero2 trace of the same run that
# differs from it ONLY in legitimate rounding (tests/peers/reference_trace.sh writes it to REF/twin: zero2
# --portable, its own gemm, so every product sums in another order; in 16-bit also started from the initial
# weights rounded toward zero to 16 bits, which changes its forward from step 1 on by one 16-bit rounding of
# every weight, as another implementation's roundings do). How far that run lies from zero2's, at
# each step and for each tensor, is the legitimate spread; a peer is allowed TWIN_FACTOR times it, plus a
# floor for what the twin cannot show (a reduction in another order: torch's vector_norm; 16-bit products
# rounded at other places, which the twin's step 1 shares with zero2).
#
# No verdict at a step depends on a later one: every spread is a running maximum over the steps up to it.

TWIN_FACTOR = 10.0  # set once from the correct variants of the corpus's development half (notes/12)

# The floors: a per-tensor relative gradient difference (|theirs - zero2|_2 / |zero2|_2) any correct peer may
# show at step 1 (fp32: the blocked sums over positions, measured 3e-7 for torch and --portable; 16-bit: its
# products rounded to the format at other places, about u = half the spacing per product), and a parameter's
# median |difference| per unit of the rates summed (fp32: measured 9e-8 for torch; 16-bit: AdamW's 2 u of lr a
# step, notes/12).
GRADIENT_FLOOR = {"fp32": 1e-5, "bf16": 2.0 ** -6, "fp16": 2.0 ** -9}
PARAMETER_FLOOR = {"fp32": 2e-6, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
# A comparison whose allowance is this large against the quantity itself sees nothing: it is reported as not
# checkable at this precision, never as agreement.
CHECKABLE = 0.5


def relative_l2(a, b):
    """|a - b|_2 / |a|_2 (0 where both are 0, inf where only a is)."""
    scale = float(np.sqrt(np.dot(a.reshape(-1), a.reshape(-1))))
    distance = float(np.sqrt(np.sum((b - a) ** 2)))
    return distance / scale if scale > 0 else (0.0 if distance == 0 else math.inf)


class Allowances:
    """The allowance of every compared quantity at every step: TWIN_FACTOR x the legitimate spread the twin
    trace shows up to that step (a running maximum), plus the floor. Without a twin, the analytic
    tolerances above, and the checker says so.

    ref, twin: tests/peers/trace_files.Trace of zero2's trace and of its twin (or None); read(side,
    kind, step) returns {name: float64 array} or None (the checker's cached reader)."""

    def __init__(self, ref, twin, read, psi, precision, positions):
        self.ref, self.twin, self.read, self.psi, self.precision = ref, twin, read, psi, precision
        self.positions = positions  # the global batch's positions: the sum behind each gradient element
        self.scalar_spread = {"loss": 0.0, "grad_norm": 0.0}
        self.gradient_spread, self.parameter_spread = {}, {}  # name -> running maximum
        self.reached = 0
        self.reached_step = 0  # the walk's step, for the written bounds that grow with it

    def advance(self, step, kind=None):
        """Take in the twin's steps up to `step` (the walk's order): kind None, its recorded loss and norm;
        "gradients" or "parameters", its tensors of that kind at `step` (read where the walk reads zero2's,
        so that a damaged file is met at the same check)."""
        self.reached_step = step
        if self.twin is None:
            return
        if kind is not None:
            if step in self.ref.parameter_steps and step in self.twin.parameter_steps and \
                    (kind == "parameters" or (self.ref.parameter_steps[step] and self.twin.parameter_steps[step])):
                self._tensor_spread(step, kind)
            return
        while self.reached < step:
            self.reached += 1
            t = self.reached
            mine, other = self.ref.steps[t - 1], self.twin.steps[t - 1]
            for key in self.scalar_spread:
                if is_finite_number(mine.get(key)) and is_finite_number(other.get(key)) and mine[key]:
                    self.scalar_spread[key] = max(self.scalar_spread[key], abs(other[key] - mine[key]) / abs(mine[key]))

    def _tensor_spread(self, t, kind):
        spread = self.gradient_spread if kind == "gradients" else self.parameter_spread
        mine, other = self.read("ref", kind, t), self.read("twin", kind, t)
        if mine is None or other is None:
            return
        if kind == "parameters":
            start, other_start = self.read("ref", kind, 0), self.read("twin", kind, 0)
        for name, values in mine.items():
            if name not in other or other[name].shape != values.shape:
                continue
            if kind == "gradients":
                d = relative_l2(values, other[name])
            else:  # the updates since each side's own start (the twin's is rounded in 16-bit), as the checker
                d = float(np.median(np.abs((other[name] - other_start[name]) - (values - start[name]))))
            if math.isfinite(d):
                spread[name] = max(spread.get(name, 0.0), d)

    def calibrated(self):
        return self.twin is not None

    def scalar(self, key, value, step, terms):
        """The loss's or the norm's allowance (absolute) at `step`."""
        if not self.calibrated():
            return (loss_tolerance if key == "loss" else norm_tolerance)(value, step, self.precision, terms)
        # The floor: the reduction's own rounding (the written bound's sum term, which does not grow with the
        # steps: torch's vector_norm sums in another order than zero2's tree) and a few fp32 ulp; the norm in
        # 16-bit also one unit of the format (the gradient it sums is rounded at other places than the twin's:
        # measured, FSDP's bf16 norm 9e-4 from zero2's at step 1, 0.11 of a unit). Then TWIN_FACTOR x the
        # relative spread of the twin up to here.
        if key == "loss":
            # In 16-bit each selected position's cross-entropy also moves by its logits' rounding, about half
            # a unit of the format, independently of the others: their mean by that over sqrt(m) (measured:
            # a bf16 torch peer's loss 1.6e-5 from zero2's at step 1, N = 2, A = 4, where the twin's was 0).
            floor = loss_tolerance(value, 0, "fp32", terms) + \
                (0.5 * UNIT[self.precision] / math.sqrt(max(terms, 1)) * abs(value) if self.precision != "fp32" else 0.0)
        else:
            floor = norm_tolerance(value, 0, "fp32", terms) + \
                (UNIT[self.precision] * abs(value) if self.precision != "fp32" else 0.0)
        return floor + TWIN_FACTOR * self.scalar_spread[key] * abs(value)

    def _pooled(self, spread):
        values = sorted(spread.values())
        return values[len(values) // 2] if values else 0.0

    def gradient(self, name):
        """A tensor's allowed |theirs - zero2|_2 / |zero2|_2 at the step the walk reached (twin: its
        own spread, at least the median tensor's: a tensor whose twin happened to match exactly says
        nothing of another implementation's order)."""
        floor = self.gradient_floor()
        if not self.calibrated():
            # The written bound grows with the steps, as the parameters carry each step's rounding forward
            # (the factor 1 + s of gradient_tolerance): nothing measured says how fast.
            return (1 + self.reached_step) * floor
        return floor + TWIN_FACTOR * max(self.gradient_spread.get(name, 0.0), self._pooled(self.gradient_spread))

    def gradient_floor(self):
        """A tensor's gradient's floor: GRADIENT_FLOOR, in 16-bit grown with the positions each element sums."""
        floor = GRADIENT_FLOOR[self.precision]
        if self.precision != "fp32":
            # Each gradient element is a sum over the global batch's positions of products whose inputs another
            # implementation rounds to 16 bits at other places: a random walk of that many roundings, which a
            # sum that cancels (a LayerNorm bias's, the token-type row's) turns into a relative error growing as
            # sqrt(positions). Measured at step 1: FSDP's bf16 0.018 of a tensor's norm at 256 positions, 0.10 at
            # 2,048 (BERT-mini's default batch), where the twin, whose start alone differs, is 0.008.
            floor *= math.sqrt(max(self.positions, 256) / 256)
        return floor

    def parameter_median(self, name, lr_sum):
        """A tensor's allowed median |theirs - zero2| after the step the walk reached; lr_sum: the rates summed
        over steps 1 .. s."""
        floor = PARAMETER_FLOOR[self.precision] * lr_sum
        if not self.calibrated():
            return parameter_tolerances(lr_sum, self.precision)[0]
        return floor + TWIN_FACTOR * max(self.parameter_spread.get(name, 0.0), self._pooled(self.parameter_spread))


def allowance_header(pair):
    precision = pair.precision
    if pair.allowances.calibrated():
        return (f"allowances ({precision}; notes/12, \"Allowances from legitimate rounding\"): {TWIN_FACTOR:g} x "
                f"how far zero2's twin ({pair.twin.directory}: the same run in other legitimate rounding) lies from "
                f"zero2 up to each step, plus a floor: loss 4 + 2 sqrt(selected) fp32 ulp, grad norm 8 + "
                f"sqrt(Psi) = {8 + blocked_sum_ulps(pair.psi):.0f} fp32 ulp"
                f"{'' if precision == 'fp32' else ' + one ' + precision + ' unit'}, each tensor's gradient "
                f"{pair.allowances.gradient_floor():.3g} of its norm, each tensor's parameters (median) "
                f"{PARAMETER_FLOOR[precision]:.3g} x the lr summed; the largest element 2.5 x the lr summed (AdamW's "
                f"bound); each tensor moved between half and twice as far as zero2 moved it")
    return (f"allowances ({precision}; notes/12, \"Tolerances\"), analytic: no twin beside zero2's trace "
            f"(tests/peers/reference_trace.sh makes REF/twin; without it the allowances are the written bounds, and "
            f"the power below is weaker): loss (4 + s) ulp + 2 sqrt(selected) fp32 ulp, grad norm (8 + 2 s) ulp + "
            f"sqrt(Psi) = {blocked_sum_ulps(pair.psi):.0f} fp32 ulp; each tensor's gradient "
            f"{pair.allowances.gradient_floor():.3g} of its norm; parameters: median "
            f"{'1e-4' if precision == 'fp32' else '4 x ' + precision + ' spacing = ' + format(4 * UNIT[precision], 'g')}"
            f", largest 2.5, x the lr summed over steps 1 .. s" +
            ("" if precision == "fp32" else f", plus the start's {precision} rounding (median) and one {precision} "
                                            f"unit of the tensor's size (largest)")
            + "; each tensor moved between half and twice as far as zero2 moved it")
