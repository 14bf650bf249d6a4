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
import stat
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

# What a reader holds in memory at once. A trace's files are written by programs we do not control (a peer, a
# damaged copy), so their sizes are checked before they are read: trace.json is about 0.5 KB a step (96 KB
# at 200 steps), a tensor file about 4 bytes a parameter (14 MB at BERT-mini's default size). The caps leave
# room for models hundreds of times larger and stop a file that claims more (a sparse file, a runaway
# writer) before it fills the memory.
MAX_JSON_BYTES = 256 << 20
MAX_TENSOR_FILE_BYTES = 16 << 30
MAX_HEADER_BYTES = 100 << 20   # the safetensors header's own limit (its format's reference reader refuses more)


def read_regular_file(path, limit):
    """The bytes of `path`, a regular file of at most `limit` bytes, or a TraceError naming it.

    Only a regular file is read: a FIFO in the trace's place would block open() until a writer came (never,
    in a damaged trace), a device (a link to /dev/zero) would be read without end. So the file is opened
    without blocking (O_NONBLOCK: a FIFO's open returns at once), the open descriptor is fstat-ed (what was
    opened, not what the name pointed to a moment before), and only a regular file of bounded size is read,
    to exactly the size fstat gave."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise TraceError(f"{path}: cannot open it: {e.strerror}")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode) else
                    "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else
                    "a socket" if stat.S_ISSOCK(info.st_mode) else "not a file")
            raise TraceError(f"{path}: {kind}, not a regular file: a trace holds regular files only")
        if info.st_size > limit:
            raise TraceError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} this reader reads "
                             f"(not a trace's file, or a model far larger than a trace is made for)")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left != 0:
            raise TraceError(f"{path}: shorter than its size ({info.st_size:,} bytes) as it was read: changed while read")
        return b"".join(chunks)
    except OSError as e:
        raise TraceError(f"{path}: cannot read it: {e.strerror}")
    finally:
        os.close(fd)


def _unique_keys(path, where):
    """json's object_pairs_hook: an object as a dict, refusing a name given twice (json.loads would keep the
    last silently, so two readers could see two different files)."""
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise TraceError(f"{path}: {where} names {key!r} twice")
            seen[key] = value
        return seen
    return hook


def parse_json(path, blob, where):
    """`blob`'s JSON (NaN and Infinity read as the floats they name: a peer's NaN is a finding, not a parse
    error), or a TraceError naming the file."""
    try:
        return json.loads(blob.decode("utf-8"), object_pairs_hook=_unique_keys(path, where))
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: {where} is not UTF-8 ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: {where} is not JSON ({e.msg}: line {e.lineno} column {e.colno})")
    except RecursionError:
        raise TraceError(f"{path}: {where} nests deeper than a JSON reader can follow")


def is_int(value):
    """A JSON integer (bool is an int to Python, not to a trace)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_safetensors(path):
    """{name: numpy array} of a safetensors file (BF16 widened to float32, exactly).

    The file is untrusted: 8 bytes of header length (little-endian), a JSON header, the data. Every claim of
    the header is checked against the file before a byte is interpreted: the length within the file, a JSON
    object naming each tensor once, each dtype known, each shape a list of non-negative integers, each
    data_offsets two integers within the data, each tensor's byte count its shape's element count times its
    dtype's size (Python's integers: a product cannot overflow), and the tensors covering the data exactly,
    with no hole and no trailing bytes (a header 4 bytes short still parses, its padding spaces, and would
    shift every tensor: only the exact cover catches it)."""
    blob = read_regular_file(path, MAX_TENSOR_FILE_BYTES)
    if len(blob) < 8:
        raise TraceError(f"{path}: {len(blob)} bytes, shorter than a safetensors header's length (cut short?)")
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise TraceError(f"{path}: the header's length ({length:,} bytes) runs past the end of the file "
                         f"({len(blob):,} bytes; cut short?)")
    if length > MAX_HEADER_BYTES:
        raise TraceError(f"{path}: the header's length ({length:,} bytes) is more than a safetensors header may be")
    header = parse_json(path, blob[8:8 + length], "the header")
    if not isinstance(header, dict):
        raise TraceError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise TraceError(f"{path}: __metadata__ is not a JSON object")
    data = memoryview(blob)[8 + length:]
    entries = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise TraceError(f"{path}: tensor {name!r}: its header entry is not a JSON object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in entry:
                raise TraceError(f"{path}: tensor {name!r}: no field {key}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise TraceError(f"{path}: tensor {name!r}: dtype {dtype!r} is not one this reader knows "
                             f"({', '.join(sorted(_DTYPES))})")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise TraceError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= len(data)):
            raise TraceError(f"{path}: tensor {name!r}: data_offsets {offsets!r} are not two integers "
                             f"0 <= begin <= end <= {len(data):,} (the file's data bytes; cut short?)")
        item = np.dtype(_DTYPES[dtype])
        count = 1
        for d in shape:
            count *= d   # Python's integers: exact, whatever the shape claims
        if offsets[1] - offsets[0] != count * item.itemsize:
            raise TraceError(f"{path}: tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]:,} "
                             f"bytes; shape {shape} of {dtype} is {count * item.itemsize:,}")
        entries.append((offsets[0], offsets[1], name, dtype, shape, item))
    entries.sort(key=lambda e: (e[0], e[1]))
    covered = 0
    for begin, end, name, *_ in entries:
        if begin != covered:
            raise TraceError(f"{path}: tensor {name!r}: data_offsets begin at {begin:,}, "
                             + (f"inside the bytes of another tensor (which end at {covered:,})" if begin < covered
                                else f"leaving bytes {covered:,} .. {begin:,} no tensor's (a hole)"))
        covered = end
    if covered != len(data):
        raise TraceError(f"{path}: the tensors' data_offsets end at byte {covered:,} of the {len(data):,} data "
                         f"bytes: the rest is no tensor's (a header of another length, or bytes appended)")
    tensors = {}
    for begin, end, name, dtype, shape, item in entries:
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
    """A trace directory, read: trace.json's fields as attributes, the rest on demand.

    What every reader needs is checked here, each with a message naming the file and the field: the format and
    version, the sections (objects), the records (one per step, in order), the kept steps (integers naming
    recorded steps, once each). What only a reference needs (the layout, the rates, the optimizer's settings)
    is checked by the checker, which knows which side is which."""

    def __init__(self, directory):
        self.directory = directory
        path = os.path.join(directory, "trace.json")
        if not os.path.isdir(directory):
            raise TraceError(f"{directory}: not a directory (a trace is the directory --trace wrote)")
        if not os.path.lexists(path):
            raise TraceError(f"{path}: missing: not a trace, or one whose run has not finished writing it")
        self.json = parse_json(path, read_regular_file(path, MAX_JSON_BYTES), "trace.json")
        if not isinstance(self.json, dict) or self.json.get("format") != FORMAT:
            raise TraceError(f"{path}: 'format' is {self.json.get('format') if isinstance(self.json, dict) else None!r}, "
                             f"not {FORMAT!r}")
        if self.json.get("version") != VERSION or isinstance(self.json.get("version"), bool):
            raise TraceError(f"{path}: 'version' is {self.json.get('version')!r}; this reader reads version {VERSION}")
        self.path = path
        for key in ("producer", "model", "run", "optimizer", "steps", "parameter_steps"):
            if key not in self.json:
                raise TraceError(f"{path}: no field {key!r}")
        for key in ("model", "run", "optimizer"):
            if not isinstance(self.json[key], dict):
                raise TraceError(f"{path}: {key!r} is {type(self.json[key]).__name__} {_brief(self.json[key])}, "
                                 f"not an object of settings")
        self.producer, self.model, self.run = self.json["producer"], self.json["model"], self.json["run"]
        self.optimizer, self.steps = self.json["optimizer"], self.json["steps"]
        self.layout = self.json.get("layout")
        self.conventions = self.json.get("conventions", {})
        self.loss_scaling = self.json.get("loss_scaling")
        if not isinstance(self.steps, list):
            raise TraceError(f"{path}: 'steps' is not a list")
        for k, record in enumerate(self.steps):
            if not isinstance(record, dict) or record.get("step") != k + 1 or isinstance(record.get("step"), bool):
                raise TraceError(f"{path}: steps[{k}] is not the record of step {k + 1}")
        self.parameter_steps = self._kept_steps(path, self.json["parameter_steps"])
        self._batches = None

    def _kept_steps(self, path, entries):
        """{step: whether its gradients are kept} from parameter_steps: a list of {"step": s, "gradients": b},
        each s an integer naming a recorded step, once. A step written as "1" or 1.0 is refused, not dropped:
        a reader that skipped it would compare nothing and could call that agreement."""
        if not isinstance(entries, list):
            raise TraceError(f"{path}: parameter_steps is {_brief(entries)}, not a list of {{\"step\": s, "
                             f"\"gradients\": true|false}}")
        kept = {}
        for k, entry in enumerate(entries):
            if not isinstance(entry, dict) or "step" not in entry:
                raise TraceError(f"{path}: parameter_steps[{k}] is {_brief(entry)}, not {{\"step\": s, "
                                 f"\"gradients\": true|false}}")
            step, gradients = entry["step"], entry.get("gradients", False)
            if is_int(step) and step > len(self.steps) >= 0:  # kept, but its record is gone
                raise TraceError(f"{path}: step {len(self.steps) + 1} is missing from steps (it records 1 .. "
                                 f"{len(self.steps)}, parameter_steps[{k}] keeps step {step})")
            if not is_int(step) or not 1 <= step <= len(self.steps):
                raise TraceError(f"{path}: parameter_steps[{k}].step is {step!r}, not the integer of a recorded "
                                 f"step (1 .. {len(self.steps)})")
            if not isinstance(gradients, bool):
                raise TraceError(f"{path}: parameter_steps[{k}].gradients is {gradients!r}, not true or false")
            if step in kept:
                raise TraceError(f"{path}: parameter_steps lists step {step} twice")
            kept[step] = gradients
        return kept

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
                if name not in tensors or tensors[name].ndim != 3 or tensors[name].shape[0] != len(self.steps):
                    raise TraceError(f"{path}: no {name} of {len(self.steps)} steps ([steps, N*A*B, T])")
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


def _brief(value):
    """A value as a message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value):
    """A float for JSON, or None (null) when there is none or it is not finite (JSON has no NaN)."""
    return None if value is None or not np.isfinite(value) else float(value)


def rounded_to(values, precision):
    """values rounded to `precision` (to nearest, ties to even), as a 16-bit copy of them holds them, in
    float64 (tests/check_trace.py; the twin's start below)."""
    if precision == "fp16":
        return values.astype(np.float16).astype(np.float64)
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def truncated_to(values, precision):
    """values rounded toward zero to `precision`, in float64: a 16-bit copy made by truncation."""
    if precision == "fp16":
        nearest = values.astype(np.float16)
        wider = np.abs(nearest.astype(np.float64)) > np.abs(values)
        nearest[wider] = np.nextafter(nearest[wider], np.float16(0))
        return nearest.astype(np.float64)
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def twin_start(source, destination, precision):
    """A copy of the Hugging Face directory `source` (a trace's initial/) whose weights are rounded toward zero
    to `precision`, still stored as float32: the start of the twin of a 16-bit run (tests/peers/reference_trace.sh).
    Toward zero, not to nearest: zero2's forward already uses the nearest 16-bit copy, so a start rounded to
    nearest would give the twin zero2's own step 1; truncation changes about half the working copy's elements by
    one unit, the scale at which two 16-bit implementations' roundings differ from the first step on."""
    import shutil
    shutil.copytree(source, destination)
    weights = read_safetensors(os.path.join(source, "model.safetensors"))
    write_safetensors(os.path.join(destination, "model.safetensors"),
                      {name: truncated_to(v, precision).astype(np.float32) for name, v in weights.items()})


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 5 and sys.argv[1] == "twin-start" and sys.argv[4] in ("bf16", "fp16"):
        twin_start(*sys.argv[2:5])
    else:
        sys.exit("usage: trace_files.py twin-start SOURCE DESTINATION bf16|fp16")
