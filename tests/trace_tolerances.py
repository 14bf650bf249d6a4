"""tests/trace_tolerances.py: how far another implementation's trace may lie from zero2's, and the
comparisons of numbers and settings the checker makes with them (tests/check_trace.py; notes/12,
"Tolerances"). Imported by the checker and its diagnoses; nothing here reads a file.
"""
import math


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
