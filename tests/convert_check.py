#!/usr/bin/python3
"""convert_check.py: zero2's float32 -> bf16 / fp16 rounding against torch's.

What it checks. Tensor.to(torch.bfloat16) and .to(torch.float16) in the
Debian torch against build/convert_tool (zero2.h's bf16_bits_from_float and
fp16_bits_from_float), bit for bit, on: every sign and every exponent (all 256,
infinities and NaNs included), with mantissas at and around every bit
position (the ties, with an even and with an odd kept bit, just below and
above them, the carries into the exponent), plus 2^20 random patterns. Both
formats' largest finite values, their overflow ties, their smallest
subnormals and their halves come out of these patterns. NaNs must stay NaN
(the payloads differ by design: torch gives 0x7fc0 / 0x7e00, zero2 and CUDA
0x7fff).

How to run:  /usr/bin/python3 tests/convert_check.py build/convert_tool
Last line: N passed, M failed.
"""
import subprocess
import sys

import numpy as np
import torch


def inputs():
    mantissas = {0, 1, 2, 3, 0x7FFFFF, 0x7FFFFE, 0x400000, 0x3FFFFF}
    for b in range(23):
        bit, nxt = 1 << b, (2 << b) if b < 22 else 0
        for m in (bit, bit - 1, bit + 1, bit | nxt, (bit | nxt) - 1, (bit | nxt) + 1,
                  0x7FFFFF & ~(bit - 1), 0x7FFFFF & ~bit):
            mantissas.add(m & 0x7FFFFF)
    rng = np.random.default_rng(7)
    mantissas.update(int(m) for m in rng.integers(0, 1 << 23, 32))
    m = np.array(sorted(mantissas), dtype=np.uint32)
    e = np.arange(256, dtype=np.uint32)
    grid = (e[:, None] << 23 | m[None, :]).ravel()
    grid = np.concatenate([grid, grid | np.uint32(1 << 31)])
    randoms = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([grid, randoms]), len(grid)


def main(argv):
    if len(argv) != 1:
        print("usage: convert_check.py CONVERT_TOOL", file=sys.stderr)
        return 2
    bits, grid = inputs()
    floats = bits.view(np.float32)
    out = subprocess.run([argv[0]], input=floats.astype("<f4").tobytes(), capture_output=True, check=True).stdout
    ours = np.frombuffer(out, dtype="<u2").reshape(-1, 2)
    passed = failed = 0
    nan = np.isnan(floats)
    for column, dtype, name in ((0, torch.bfloat16, "bf16"), (1, torch.float16, "fp16")):
        theirs = torch.from_numpy(floats.copy()).to(dtype).view(torch.int16).numpy().view(np.uint16)
        mine = ours[:, column]
        exponent_mask = np.uint16(0x7F80 if name == "bf16" else 0x7C00)
        mine_nan = ((mine & exponent_mask) == exponent_mask) & ((mine & np.uint16(0x7FFF)) != exponent_mask)
        theirs_nan = ((theirs & exponent_mask) == exponent_mask) & ((theirs & np.uint16(0x7FFF)) != exponent_mask)
        bad = np.where(nan, ~(mine_nan & theirs_nan), mine != theirs)
        count = int(bad.sum())
        first = ""
        if count:
            i = int(np.flatnonzero(bad)[0])
            first = f"; first: 0x{bits[i]:08x} -> ours 0x{mine[i]:04x}, torch 0x{theirs[i]:04x}"
        ok = count == 0
        print(f"{'PASS' if ok else 'FAIL'} {name} rounding equals torch's .to({dtype}) on {len(bits):,} floats "
              f"({grid:,} at every exponent and boundary, {int(nan.sum()):,} NaNs): {count} differ{first}")
        passed, failed = passed + ok, failed + (not ok)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
