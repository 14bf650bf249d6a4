"""tests/peers/trace_files.py: a zero2 trace read and a peer's trace written,
with numpy and the standard library alone (notes/12, "The trace").

A trace is a directory:

    trace.json               the settings, conventions, layout and every step's record; written last
    initial/                 the weights step 1 starts from (Hugging Face layout: config.json, model.safetensors)
    batches.safetensors      input_ids, labels: int64 [steps, N*A*B, T] (zero2's traces; a peer's need not)
    step_<s>/model.safetensors       the parameters after optimizer step s, by Hugging Face names
    step_<s>/gradients.safetensors   the gradient step s applied (before clipping), by the same names

A peer (tests/peers/torch_peer.py, tests/peers/deepspeed_peer.py, your own)
reads zero2's trace with Trace(dir), replays it, and writes its own with
PeerTrace: the same format, its own numbers. tests/check_trace.py compares
the two. safetensors is parsed by hand (8 bytes of header length, a JSON
header, raw little-endian data), so neither side needs the safetensors
package.
"""
import json
import os
import struct
import tempfile

import numpy as np

FORMAT, VERSION = "zero2-trace", 1


class TraceError(Exception):
    """A trace that cannot be read: the message names the file and the field."""


_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
           "U8": "u1", "BOOL": "?", "BF16": "<u2"}
_NUMPY = {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
          np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("bool"): "BOOL"}


def read_safetensors(path):
    """{name: numpy array} of a safetensors file (BF16 widened to float32, exactly)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror}")
    if len(blob) < 8:
        raise TraceError(f"{path}: shorter than a safetensors header (cut short?)")
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise TraceError(f"{path}: the header's length runs past the end of the file (cut short?)")
    try:
        header = json.loads(blob[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: the header is not JSON ({e})")
    if not isinstance(header, dict):
        raise TraceError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data = memoryview(blob)[8 + length:]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{path}: tensor {name!r} has a malformed header entry")
        if dtype not in _DTYPES:
            raise TraceError(f"{path}: tensor {name!r} has a dtype this reader does not know: {dtype}")
        item = np.dtype(_DTYPES[dtype])
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= begin <= end <= len(data)) or end - begin != count * item.itemsize:
            raise TraceError(f"{path}: tensor {name!r}'s bytes [{begin}, {end}) do not hold {shape} {dtype} "
                             f"in the file's {len(data)} data bytes (cut short?)")
        array = np.frombuffer(data[begin:end], dtype=item).reshape(shape)
        if dtype == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.astype(array.dtype.newbyteorder("="))
    return tensors


def _write_atomically(path, chunks):
    """The file whole under its name, or nothing: a temporary in the same directory, then rename."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(handle, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_safetensors(path, tensors):
    """tensors: {name: numpy array} (float32 and int64 are what a trace holds)."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _NUMPY:
            raise ValueError(f"cannot store {name} as {array.dtype}")
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _NUMPY[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    _write_atomically(path, [struct.pack("<Q", len(text)), text] + chunks)


def write_json(path, value):
    _write_atomically(path, [(json.dumps(value, indent=1) + "\n").encode()])


class Trace:
    """A trace directory, read: trace.json's fields as attributes, the rest on demand."""

    def __init__(self, directory):
        self.directory = directory
        path = os.path.join(directory, "trace.json")
        if not os.path.isdir(directory):
            raise TraceError(f"{directory}: not a directory (a trace is the directory --trace wrote)")
        if not os.path.exists(path):
            raise TraceError(f"{path}: missing: not a trace, or one whose run has not finished writing it")
        try:
            with open(path, "rb") as f:
                self.json = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceError(f"{path}: not a trace.json we can read ({e})")
        if not isinstance(self.json, dict) or self.json.get("format") != FORMAT:
            raise TraceError(f"{path}: 'format' is {self.json.get('format') if isinstance(self.json, dict) else None!r}, "
                             f"not {FORMAT!r}")
        if self.json.get("version") != VERSION:
            raise TraceError(f"{path}: 'version' is {self.json.get('version')!r}; this reader reads version {VERSION}")
        self.path = path
        for key in ("producer", "model", "run", "optimizer", "steps", "parameter_steps"):
            if key not in self.json:
                raise TraceError(f"{path}: no field {key!r}")
        self.producer, self.model, self.run = self.json["producer"], self.json["model"], self.json["run"]
        self.optimizer, self.steps = self.json["optimizer"], self.json["steps"]
        self.layout = self.json.get("layout")
        self.conventions = self.json.get("conventions", {})
        self.loss_scaling = self.json.get("loss_scaling")
        if not isinstance(self.steps, list):
            raise TraceError(f"{path}: 'steps' is not a list")
        for k, record in enumerate(self.steps):
            if not isinstance(record, dict) or record.get("step") != k + 1:
                raise TraceError(f"{path}: steps[{k}] is not the record of step {k + 1}")
        self.parameter_steps = {entry["step"]: entry.get("gradients", False) for entry in self.json["parameter_steps"]}
        self._batches = None

    def field(self, section, key):
        """trace.json's section.key, or a TraceError naming it."""
        try:
            return self.json[section][key]
        except (KeyError, TypeError):
            raise TraceError(f"{self.path}: no field {section}.{key}")

    def batch(self, step):
        """(input_ids, labels) of optimizer step `step` (1-based): int64 [N*A*B, T]; row m*B + b is sample b of
        global micro-batch m."""
        if self._batches is None:
            path = os.path.join(self.directory, "batches.safetensors")
            tensors = read_safetensors(path)
            for name in ("input_ids", "labels"):
                if name not in tensors or tensors[name].shape[0] != len(self.steps):
                    raise TraceError(f"{path}: no {name} of {len(self.steps)} steps")
            self._batches = tensors
        return self._batches["input_ids"][step - 1], self._batches["labels"][step - 1]

    def initial_directory(self):
        return os.path.join(self.directory, "initial")

    def parameters(self, step):
        """{Hugging Face name: float32 array} after optimizer step `step` (0: the initial weights)."""
        if step != 0 and step not in self.parameter_steps:
            raise TraceError(f"{self.path}: parameter_steps does not list step {step}")
        where = "initial" if step == 0 else f"step_{step}"
        return read_safetensors(os.path.join(self.directory, where, "model.safetensors"))

    def gradients(self, step):
        """{name: float32 array}: the gradient step `step` applied, or None when the trace did not keep it."""
        if not self.parameter_steps.get(step):  # not kept (a file there is another run's)
            return None
        return read_safetensors(os.path.join(self.directory, f"step_{step}", "gradients.safetensors"))


class PeerTrace:
    """A peer's trace of its replay of `reference` (a Trace): rank 0 writes it.

        trace = PeerTrace(out_dir, reference, producer="my ZeRO-2, 2 ranks")
        trace.step(step, loss=..., grad_norm=..., lr=...)          # every step, in order
        trace.parameters(step, {name: array}, {name: gradient})   # at the steps reference keeps
        trace.finish()                                            # trace.json, last
    """

    def __init__(self, directory, reference, producer):
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(os.path.join(directory, "trace.json")):
            os.unlink(os.path.join(directory, "trace.json"))  # not whole again until finish()
        self.directory, self.reference, self.producer = directory, reference, producer
        self.records, self.kept = [], []

    def step(self, step, loss, grad_norm, lr, loss_scale=1.0, skipped=False):
        """loss, grad_norm: None (or not finite) where the step had none, as zero2 writes null for an fp16
        step that overflowed."""
        if step != len(self.records) + 1:
            raise ValueError(f"step {step} recorded after {len(self.records)} steps")
        self.records.append({"step": step, "loss": _finite(loss), "grad_norm": _finite(grad_norm), "lr": float(lr),
                             "loss_scale": float(loss_scale), "skipped": bool(skipped)})

    def parameters(self, step, parameters, gradients=None):
        where = os.path.join(self.directory, f"step_{step}")
        os.makedirs(where, exist_ok=True)
        if gradients is not None:
            write_safetensors(os.path.join(where, "gradients.safetensors"),
                              {name: np.asarray(g, dtype=np.float32) for name, g in gradients.items()})
        write_safetensors(os.path.join(where, "model.safetensors"),
                          {name: np.asarray(p, dtype=np.float32) for name, p in parameters.items()})
        self.kept.append({"step": step, "gradients": gradients is not None})

    def finish(self, optimizer=None, **settings):
        """trace.json: the reference's model, run and optimizer sections (what the peer replayed), `settings`
        overriding run fields the peer did differently, `optimizer` the optimizer fields it used (betas, eps,
        weight_decay, clip, ... as its own optimizer holds them), its own steps."""
        run = dict(self.reference.run, steps=len(self.records), **settings)
        write_json(os.path.join(self.directory, "trace.json"), {
            "format": FORMAT, "version": VERSION, "producer": self.producer,
            "model": self.reference.model, "run": run, "optimizer": dict(self.reference.optimizer, **(optimizer or {})),
            "parameter_steps": self.kept, "steps": self.records})


def _finite(value):
    """A float for JSON, or None (null) when there is none or it is not finite (JSON has no NaN)."""
    return None if value is None or not np.isfinite(value) else float(value)
