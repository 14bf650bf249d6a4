"""tests/cli/common.py — the Python the command-line suite's files share (tests/cli/common.sh calls it).

    common.py get FILE EXPR                     print EXPR, a Python expression over the JSON file read as d
    common.py resumed_matches STRAIGHT RESUMED [skips]
                                                "ok" when the resumed run's final hash and the loss bits, skips
                                                and scales of each of its steps equal the straight run's;
                                                with "skips", its steps must include a skipped one and a
                                                scale change; else what differs
    common.py flip_middle_bit FILE              flip the lowest bit of the file's middle byte
    common.py flip_digit FILE KEY               flip the lowest bit of the last digit of the first "KEY": value
    common.py edit_json FILE STATEMENT          run STATEMENT on the JSON file read as d, and write d back
"""
import json
import re
import sys


def get(path, expression):
    d = json.load(open(path))  # noqa: F841 (the expression reads it)
    print(eval(expression))


def resumed_matches(straight_path, resumed_path, skips=None):
    a, b = (json.load(open(p)) for p in (straight_path, resumed_path))
    straight = {s["step"]: (s["loss_bits"], s["skipped"], s["loss_scale"]) for s in a["steps"]}
    mine = [(s["step"], (s["loss_bits"], s["skipped"], s["loss_scale"])) for s in b["steps"]]
    problems = []
    if a["final_params_hash"] != b["final_params_hash"]:
        problems.append(f"hash {b['final_params_hash']} != {a['final_params_hash']}")
    if not mine:
        problems.append("no steps resumed")
    problems += [f"step {k}" for k, v in mine if straight.get(k) != v]
    if skips and not (any(v[1] for _, v in mine) and len({v[2] for _, v in mine}) > 1):
        problems.append("no skip or no scale change after the checkpoint")
    print("ok" if not problems else "; ".join(problems[:4]))


def flip_middle_bit(path):
    b = bytearray(open(path, "rb").read())
    b[len(b) // 2] ^= 1
    open(path, "wb").write(b)


def flip_digit(path, key):
    b = bytearray(open(path, "rb").read())
    m = re.search(rb'"' + key.encode() + rb'": (-?[0-9.e+-]+)', b)
    at = m.end(1) - 1
    while not chr(b[at]).isdigit():
        at -= 1
    b[at] ^= 1
    open(path, "wb").write(b)


def edit_json(path, statement):
    d = json.load(open(path))
    exec(statement)
    json.dump(d, open(path, "w"))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
