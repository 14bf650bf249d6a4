"""tests/checker_corpus/test_score.py: score.py's reading of the checker's lines (named:, fits:, power-json:),
on made-up outputs, since the checker that prints them is being written. python3 tests/checker_corpus/test_score.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score import score  # noqa: E402

BUG = {"kind": "bug", "cls": "reduction.summed", "size": {"grad_scale": 1.0}}
EPS = {"kind": "bug", "cls": "adamw.eps-other", "size": {"eps": 99.0}}
CLIP = {"kind": "bug", "cls": "clipping.threshold-scaled", "size": {"clip": 0.05}}
CORRECT = {"kind": "correct", "cls": None, "size": {}}
FAIL = "FAIL step 1, gradient of x[(0, 0)]\nmargin: the difference is 4.2e+04 x its tolerance\n"
PASS = "PASS: theirs agrees with zero2 at all 8 steps and 8 kept steps (the closest call: step 2, 0.06 of the tolerance)\n"
CASES = [
    (CORRECT, 0, 0, PASS, ("passed", "", True)),
    (CORRECT, 0, 1, FAIL, ("failed", "", False)),
    (BUG, 0, 1, FAIL, ("failed", "unnamed", True)),
    (BUG, 0, 1, FAIL + "named: reduction.summed\n", ("failed", "named", True)),
    (BUG, 0, 1, FAIL + "named: reduction.averaged-twice (the factor 1/N)\n", ("failed", "misnamed", False)),
    (BUG, 0, 1, FAIL + "named: none\n", ("failed", "unnamed", True)),  # names nothing: not a wrong name
    (BUG, 0, 1, FAIL + "fits: reduction.summed, loss.summed-over-ranks (both give N x)\n", ("failed", "ambiguity", True)),
    (BUG, 0, 1, FAIL + "fits: accumulation.summed-not-averaged, loss.divided-by-A (...)\n", ("failed", "misnamed", False)),
    (BUG, 0, 0, PASS, ("passed silently", "", False)),
    (CLIP, 0, 0, PASS + 'power-json: {"lr": 0.1, "weight_decay": null, "grad_scale": 0.5, "clip": "unbounded"}\n',
     ("passed by stated limit", "", True)),  # no clip error of any size could show, and the PASS says so
    (CLIP, 0, 0, PASS + 'power-json: {"lr": 0.1, "weight_decay": null, "grad_scale": 0.5, "clip": null}\n',
     ("passed silently", "", False)),  # null: the PASS could not say
    (BUG, 0, 0, PASS + 'power-json: {"lr": 0.1, "weight_decay": null, "grad_scale": 2.0, "clip": null}\n',
     ("passed by stated limit", "", True)),
    (BUG, 0, 0, PASS + 'power-json: {"lr": 0.1, "weight_decay": null, "grad_scale": 0.5, "clip": null}\n',
     ("passed silently", "", False)),
    (BUG, 0, 0, PASS + 'power-json: {"lr": 0.1, "weight_decay": null, "grad_scale": null, "clip": null}\n',
     ("passed silently", "", False)),
    (BUG, 0, 0, PASS + "power-json: not json\n", ("passed silently", "", False)),
    (EPS, 0, 0, PASS + 'power-json: {"lr": 1e3, "weight_decay": 1e3, "grad_scale": 1e3, "clip": 1e3}\n',
     ("passed silently", "", False)),
    (BUG, 1, None, "", ("error", "", False)),
    (BUG, 3, None, "", ("error", "", False)),
    (BUG, 0, 2, "check_trace: error: ...", ("error", "", False)),
]
bad = 0
for case, peer, check, text, expected in CASES:
    result = score(case, peer, check, text)
    got = (result["outcome"], result["naming"], result["passed"])
    if got != expected:
        bad += 1
        print(f"FAIL {case['cls']} peer {peer} checker {check} {text.splitlines()[-1:]}: {got}, expected {expected}")
print(f"{len(CASES) - bad} passed, {bad} failed")
sys.exit(1 if bad else 0)
