#!/usr/bin/python3
"""tests/read_checkpoint.py — a zero2 checkpoint read without zero2, the way
DeepSpeed's zero_to_fp32.py reads its own: numpy and the standard library
only (safetensors is parsed by hand: 8 bytes of header length, a JSON header,
raw little-endian data).

    /usr/bin/python3 tests/read_checkpoint.py STEP_DIR [--compare EXPORT_DIR] [--same-as STEP_DIR2]

It checks the index against index.sha256 (its own SHA-256, in sha256sum's
format) and every file against the index (size and SHA-256), puts the files'
canonical ranges end to end and cuts the result at the parameters the index
lists, giving the full fp32 master weights, exp_avg and exp_avg_sq of every
parameter. --compare checks the weights against an --export-hf directory's
model.safetensors bit for bit (the trainer's own export at that step);
--same-as checks that two checkpoints (saved at different N or stage) hold
the same bits. Prints one line per check and exits non-zero on a mismatch.
"""
import hashlib
import json
import os
import struct
import sys

import numpy as np


def read_safetensors(path):
    """{name: numpy array} and the metadata of a safetensors file."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    dtypes = {"F32": np.float32, "I64": np.int64}
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return tensors, metadata


def read_checkpoint(step_dir):
    """(index, {parameter: {"master", "exp_avg", "exp_avg_sq"}}), every file checked."""
    with open(os.path.join(step_dir, "index.json"), "rb") as f:
        raw_index = f.read()
    with open(os.path.join(step_dir, "index.sha256")) as f:
        if f.read() != hashlib.sha256(raw_index).hexdigest() + "  index.json\n":
            raise SystemExit(f"{step_dir}/index.json: SHA-256 differs from index.sha256")
    index = json.loads(raw_index)
    assert index["format"] == "zero2 checkpoint", "not a zero2 checkpoint index"
    pieces = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    covered = 0
    for entry in index["files"]:
        path = os.path.join(step_dir, entry["file"])
        raw = open(path, "rb").read()
        if len(raw) != entry["bytes"]:
            raise SystemExit(f"{path}: {len(raw)} bytes, the index says {entry['bytes']}")
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{path}: SHA-256 differs from the index")
        if entry["begin"] != covered:
            raise SystemExit(f"{path}: starts at {entry['begin']}, the files before end at {covered}")
        tensors, metadata = read_safetensors(path)
        assert int(metadata["begin"]) == entry["begin"] and int(metadata["end"]) == entry["end"]
        for name in pieces:
            assert tensors[name].shape == (entry["end"] - entry["begin"],)
            pieces[name].append(tensors[name])
        covered = entry["end"]
    assert covered == index["psi"], f"the files cover {covered} of {index['psi']}"
    whole = {name: np.concatenate(parts) for name, parts in pieces.items()}
    parameters, at = {}, 0
    for p in index["parameters"]:
        n = p["numel"]
        assert n == int(np.prod(p["shape"])), p
        parameters[p["name"]] = {name: whole[name][at:at + n].reshape(p["shape"]) for name in whole}
        at += n
    assert at == index["psi"]
    return index, parameters


def same_bits(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def main():
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    index, parameters = read_checkpoint(args[0])
    total = sum(p["numel"] for p in index["parameters"])
    print(f"read {args[0]}: step {index['step']}, saved by {index['world_size']} rank(s), "
          f"{len(parameters)} parameters, {total} elements; the index matches index.sha256, every file's size "
          "and SHA-256 match the index")
    ok = True
    if "--compare" in args:
        export = args[args.index("--compare") + 1]
        exported, _ = read_safetensors(os.path.join(export, "model.safetensors"))
        differing = [name for name in exported if not same_bits(exported[name], parameters[name]["master"])]
        missing = sorted(set(parameters) - set(exported))
        ok &= not differing and not missing
        print(f"compare with {export}: {len(exported)} tensors, "
              + ("every one bit for bit" if not differing and not missing else f"DIFFER: {differing[:3]} missing {missing[:3]}"))
    if "--same-as" in args:
        other = args[args.index("--same-as") + 1]
        _, other_parameters = read_checkpoint(other)
        differing = [(name, part) for name in parameters for part in parameters[name]
                     if not same_bits(parameters[name][part], other_parameters[name][part])]
        ok &= not differing and set(parameters) == set(other_parameters)
        print(f"same as {other}: " + ("master, exp_avg and exp_avg_sq bit for bit" if not differing else f"DIFFER: {differing[:3]}"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
