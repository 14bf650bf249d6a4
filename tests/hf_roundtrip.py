#!/usr/bin/python3
"""tests/hf_roundtrip.py — the trainer's export through Hugging Face itself:
AutoTokenizer, AutoModelForMaskedLM and pipeline("fill-mask") on the
directory the trainer wrote, as a user of transformers would load it.

    PYTHON tests/hf_roundtrip.py DUMP_DIR

DUMP_DIR is a --dump-batch directory of a --dropout 0 run on ASCII text (so
every window of bytes is a string): it holds the step's weights as an HF
export (model.safetensors, config.json, the tokenizer files) and the batch
(batch.safetensors: input_ids, labels, loss). PYTHON is a python with
transformers (make test-deps makes .venv-hf: Debian's python, its torch, and
transformers 4.39.3 from PyPI). Prints one PASS/FAIL line per check, then
"N passed, M failed"; exits non-zero on a failure.

Checks:
  1. the shipped tokenizer gives the trainer's ids: each row's original
     bytes (a label where the position was selected, else the input id),
     decoded to text and tokenized, is the row exactly ([CLS] bytes [SEP]);
  2. AutoModelForMaskedLM in eval mode (no dropout) computes the dumped
     loss on the dumped batch: relative 1e-5 (the same fp32 arithmetic in
     another order: softmax, GELU and the matrix products are summed
     differently, so not bit for bit); no missing or unexpected keys;
  3. pipeline("fill-mask") runs on the directory and fills a [MASK] with
     tokens of the vocabulary.
"""
import json
import os
import struct
import sys

import numpy as np
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

passed = failed = 0


def report(ok, text):
    global passed, failed
    print(("PASS " if ok else "FAIL ") + text)
    passed, failed = passed + ok, failed + (not ok)


def read_safetensors(path):
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
        data = f.read()
    header.pop("__metadata__", None)
    types = {"F32": np.float32, "I64": np.int64}
    return {name: np.frombuffer(data[e["data_offsets"][0]:e["data_offsets"][1]], dtype=types[e["dtype"]]).reshape(e["shape"])
            for name, e in header.items()}


def main(directory):
    batch = read_safetensors(os.path.join(directory, "batch.safetensors"))
    input_ids, labels, dumped_loss = batch["input_ids"], batch["labels"], float(batch["loss"])

    # 1. The tokenizer: each row's original text, tokenized, is the row.
    tokenizer = AutoTokenizer.from_pretrained(directory)
    original = np.where(labels >= 0, labels, input_ids)
    rows_equal = 0
    for row in original:
        text = bytes(int(t) for t in row[1:-1]).decode("ascii")
        ids = tokenizer(text)["input_ids"]
        rows_equal += ids == [int(t) for t in row]
    report(rows_equal == len(original),
           f"AutoTokenizer: {rows_equal} of {len(original)} rows tokenize to the trainer's ids ([CLS] bytes [SEP])")
    special = (tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id)
    report(special == (256, 257, 258, 259), f"special tokens [PAD] [CLS] [SEP] [MASK] = {special} (want 256..259)")

    # 2. The model: the dumped loss on the dumped batch, in eval mode.
    model, info = AutoModelForMaskedLM.from_pretrained(directory, output_loading_info=True)
    model.eval()
    keys_ok = not info["missing_keys"] and not info["unexpected_keys"]
    report(keys_ok, f"AutoModelForMaskedLM: missing keys {info['missing_keys']}, unexpected {info['unexpected_keys']}")
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(input_ids.copy()), labels=torch.from_numpy(labels.copy()))
    loss = float(out.loss)
    relative = abs(loss - dumped_loss) / abs(dumped_loss)
    report(relative <= 1e-5, f"loss on the dumped batch: transformers {loss:.8f}, trainer {dumped_loss:.8f}, "
                             f"relative {relative:.2e} (<= 1e-5)")

    # 3. fill-mask, end to end.
    fill = pipeline("fill-mask", model=directory, tokenizer=directory)
    answers = fill("The quick brown [MASK]ox.")  # shorter than the smallest --max-positions used
    tokens = [a["token"] for a in answers]
    report(len(answers) == 5 and all(0 <= t < 260 for t in tokens),
           f"pipeline('fill-mask'): {len(answers)} answers, tokens {tokens}, "
           f"strings {[a['token_str'] for a in answers]}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
