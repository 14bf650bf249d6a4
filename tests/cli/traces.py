"""tests/cli/traces.py — traces (--trace) and Hugging Face directories (--init-hf) read, compared and damaged
with numpy and tests/peers/trace_files.py (tests/cli/traces.sh)."""
import json
import re
import struct
import sys

sys.path.insert(0, "tests/peers")
import numpy as np  # noqa: E402
from trace_files import Trace, read_safetensors, write_safetensors  # noqa: E402


def same_records(a_path, b_path):
    """"same" when two trace.json hold the same step records and parameter steps."""
    a, b = (json.load(open(path)) for path in (a_path, b_path))
    print("same" if a["steps"] == b["steps"] and a["parameter_steps"] == b["parameter_steps"] else "differ")


def against_dump(trace_dir, dump_dir):
    """Step 1's batch and gradients in the trace against --dump-batch's; the micro-batches' counts and losses."""
    trace, dump = Trace(trace_dir), read_safetensors(dump_dir + "/batch.safetensors")
    ids, labels = trace.batch(1)
    gradients = trace.gradients(1)
    problems = []
    if not (np.array_equal(ids, dump["input_ids"]) and np.array_equal(labels, dump["labels"])):
        problems.append("step 1's batch differs from --dump-batch's")
    for name, g in gradients.items():
        if g.tobytes() != dump["grad." + name].tobytes():
            problems.append(f"gradient {name} differs from --dump-batch's")
    record = trace.steps[0]
    counts = [int((labels[m * 2:(m + 1) * 2] != -100).sum()) for m in range(2)]
    if record["micro_batch_selected"] != counts or record["selected"] != sum(counts):
        problems.append(f"selected counts {record['micro_batch_selected']} != the batch's {counts}")
    if abs(sum(record["micro_batch_losses"]) - record["loss"]) > 4 * np.spacing(np.float32(record["loss"])):
        problems.append("the micro-batch losses do not add up to the loss")
    print("; ".join(problems) or "ok")


def edit_trace(path, statement):
    """Run statement on the trace.json at path, read as t, and write t back."""
    t = json.load(open(path))
    exec(statement)
    json.dump(t, open(path, "w"))


def edit_tensors(path, statement):
    """Run statement on the safetensors file's tensors, read as t (a dict of numpy arrays), and write t back."""
    t = read_safetensors(path)
    exec(statement)
    write_safetensors(path, t)


def edit_bytes(path, statement):
    """Run statement on the safetensors file's bytes b (with n, header and data), and write b back."""
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header, data = b[8:8 + n].rstrip(b" "), b[8 + n:]
    scope = {"b": b, "n": n, "header": header, "data": data, "struct": struct}
    exec(statement, scope)
    open(path, "wb").write(scope["b"])


def set_hidden_size(path, text):
    """config.json's hidden_size written as text (a JSON value as written, valid or not)."""
    t = open(path).read()
    open(path, "w").write(re.sub(r'"hidden_size": *[^,}]*', '"hidden_size": ' + text, t))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
