#!/usr/bin/python3
# tests/safetensors_corpus/make_corpus.py — the regression corpus of the
# safetensors reader (trainer/safetensors.cpp): one small file per way a
# file can be wrong, each made here from one valid file so a reader sees
# what was changed. tests/test_safetensors.cpp reads every file and checks
# the verdict (accepted, or refused naming the field); the fuzz target
# (tests/fuzz_safetensors.cpp, `make sanitize`) starts from these files.
#
#   python3 tests/safetensors_corpus/make_corpus.py   (writes beside itself)
#
# The files are committed; running this again writes the same bytes.
import json
import math
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def floats(values):
    return struct.pack("<%df" % len(values), *values)


# The valid file's tensors: a F32 [2, 2] and b F32 [3], 28 bytes of data.
A = floats([1.0, 2.0, 3.0, 4.0])
B = floats([0.5, -0.5, 0.25])
ENTRIES = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 28]}}


def header_text(entries, metadata=None):
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    return json.dumps(header, separators=(",", ":"))


def safetensors(text, data, padding=8, length_delta=0, length=None, trailing=b""):
    """A file: the 8-byte length (the header's own, moved by length_delta, or
    `length` outright), the header padded with `padding` spaces (as
    writers pad to a multiple of 8), the data, then `trailing` bytes."""
    body = text.encode() + b" " * padding
    said = len(body) + length_delta if length is None else length
    return struct.pack("<Q", said) + body + data + trailing


def entries_with(**changes):
    """ENTRIES with tensor fields replaced: entries_with(b={"data_offsets": [...]})."""
    entries = json.loads(json.dumps(ENTRIES))
    for name, fields in changes.items():
        entries.setdefault(name, {}).update(fields)
    return entries


valid_text = header_text(ENTRIES, {"format": "pt"})
files = {
    # accepted
    "valid.safetensors": safetensors(valid_text, A + B),
    # the header's length against the file
    "header_4_short.safetensors": safetensors(valid_text, A + B, length_delta=-4),  # padding keeps the JSON valid
    "header_1_short.safetensors": safetensors(valid_text, A + B, length_delta=-1),
    "header_past_file.safetensors": safetensors(valid_text, A + B, length=1000),
    "header_huge.safetensors": safetensors(valid_text, A + B, length=2**63),
    "too_short.safetensors": b"\x10\x00\x00",
    # the data section, exactly covered
    "trailing_bytes.safetensors": safetensors(valid_text, A + B, trailing=b"\0\0\0\0"),
    "hole.safetensors": safetensors(header_text(entries_with(b={"data_offsets": [20, 32]})), A + b"\0" * 4 + B),
    "overlap.safetensors": safetensors(header_text(entries_with(b={"data_offsets": [8, 20]})), A + B[:4]),
    "offsets_reversed.safetensors": safetensors(header_text(entries_with(b={"data_offsets": [28, 16]})), A + B),
    "offsets_out_of_range.safetensors": safetensors(header_text(ENTRIES), A + B[:4]),
    "offsets_not_two.safetensors": safetensors(header_text(entries_with(b={"data_offsets": [16]})), A + B),
    # each tensor's entry
    "bytes_not_shape.safetensors": safetensors(header_text(entries_with(b={"shape": [4]})), A + B),
    "shape_overflow.safetensors": safetensors(
        header_text({"big": {"dtype": "F32", "shape": [2**40, 2**24], "data_offsets": [0, 0]}}), b""),
    "negative_dim.safetensors": safetensors(header_text(entries_with(a={"shape": [-2, -2]})), A + B),
    "float_dim.safetensors": safetensors(header_text(entries_with(a={"shape": [2.0, 2]})), A + B),
    "unknown_dtype.safetensors": safetensors(header_text(entries_with(a={"dtype": "F33"})), A + B),
    "no_dtype.safetensors": safetensors(header_text({"a": {"shape": [4], "data_offsets": [0, 16]}}), A),
    # the header as JSON
    "duplicate_name.safetensors": safetensors(
        '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[3],'
        '"data_offsets":[16,28]}}', A + B),
    "non_object_header.safetensors": safetensors("[1,2]", b""),
    "not_json.safetensors": safetensors('{"a":', b""),
    "too_deep.safetensors": safetensors('{"a":{"shape":[[[1]]]}}', b""),
    "metadata_not_strings.safetensors": safetensors(header_text(ENTRIES, {"step": 3}), A + B),
    # the values, for --init-hf's weights
    "nan_weight.safetensors": safetensors(valid_text, floats([1.0, math.nan, 3.0, 4.0]) + B),
    "inf_weight.safetensors": safetensors(valid_text, A + floats([0.5, -0.5, -math.inf])),
}

if __name__ == "__main__":
    for name, contents in sorted(files.items()):
        with open(os.path.join(here, name), "wb") as out:
            out.write(contents)
    print("wrote %d files to %s" % (len(files), here))
