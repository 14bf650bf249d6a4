"""tests/cli/checker.py — damage done to a copy of a trace (tests/cli/checker.sh's damaged).

    checker.py damage DIR CODE   run CODE, which sees d (the copy's directory), j (its trace.json, written back
                                 after unless CODE sets j to None), tensors(path) / save(path, tensors)
                                 (safetensors through tests/peers/trace_files.py), raw(path, header, data) (a
                                 safetensors file with any header), np, os, json, struct
"""
import json
import os
import struct
import sys

sys.path.insert(0, "tests/peers")
import numpy as np  # noqa: E402,F401 (CODE uses it)
from trace_files import read_safetensors as tensors, write_safetensors as save  # noqa: E402,F401


def raw(path, header, data=b""):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def damage(d, code):
    scope = dict(globals(), d=d, j=json.load(open(os.path.join(d, "trace.json"))))
    exec(code, scope)
    if scope["j"] is not None:
        json.dump(scope["j"], open(os.path.join(d, "trace.json"), "w"))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
