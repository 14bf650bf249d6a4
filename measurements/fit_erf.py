#!/usr/bin/python3
"""Coefficients of zero2's erf (zero2.h, erf_fp32): prints the C++ lines.

erf(x) = x * P(t) for |x| < 4, where u = x^2 in [0, 16] and t = u / 8 - 1 in
[-1, 1]. P(u) = erf(sqrt u) / sqrt u is entire in u, so its Chebyshev series
converges fast: we interpolate it at the Chebyshev points of degree 22 (close
to the best polynomial of that degree) and convert to powers of t, which are
small (sum of |a_k| = 1.13), so Horner's rule in double is stable.
The reference values are Python's math.erf (double, < 1 ulp of double);
the fit's relative error is printed, and tests/test_math.cpp measures what
the C++ function gives over float inputs.
Run: /usr/bin/python3 measurements/fit_erf.py
"""
import math
import numpy as np
from numpy.polynomial import chebyshev

DEGREE = 22


def erf_over_x(u):
    """erf(sqrt u) / sqrt u, and its limit 2 / sqrt(pi) at u = 0."""
    return math.erf(math.sqrt(u)) / math.sqrt(u) if u > 0 else 2.0 / math.sqrt(math.pi)


def fitted(t):
    return np.array([erf_over_x(8.0 * (v + 1.0)) for v in np.atleast_1d(t)])


series = chebyshev.chebinterpolate(fitted, DEGREE)
powers = chebyshev.cheb2poly(series)  # powers[k] multiplies t^k
grid = np.linspace(-1.0, 1.0, 200001)
exact = fitted(grid)
error = np.max(np.abs(np.polynomial.polynomial.polyval(grid, powers) - exact) / exact)
print(f"// Chebyshev interpolant of degree {DEGREE}, in powers of t; relative error {error:.2e} on 200001 points")
print(f"constexpr double erf_coefficients[{DEGREE + 1}] = {{")
for k, value in enumerate(powers):
    print(f"    {float(value).hex()},  // t^{k}")
print("};")
