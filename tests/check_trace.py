#!/usr/bin/python3
"""tests/check_trace.py: another implementation's trace checked against zero2's (notes/12).

    /usr/bin/python3 tests/check_trace.py REF THEIRS [--twin DIR | --no-twin] [--margins] [--every-step]
    (make check-trace REF=... THEIRS=...)

REF is zero2's trace (train_bert_mini --trace DIR); THEIRS the trace a peer wrote replaying it, in the same
format (tests/peers/trace_files.py; tests/peers/torch_peer.py is a template). Step by step it compares the
learning rate, the loss and the gradient norm, and at the steps both keep, each tensor's gradient and
parameters, each against an allowance it prints: TWIN_FACTOR times how far zero2's twin (REF/twin, or --twin
DIR: zero2's same run with only legitimate rounding changed, which tests/peers/reference_trace.sh writes) lies
from zero2 up to that step, plus a floor; without a twin, the written bounds (notes/12, "Allowances from
legitimate rounding", "Tolerances"). It stops at the first step and tensor outside its allowance, says where
the differing elements lie in ZeRO's terms (which parameter, which bucket, which rank's shard at the trace's
N) and what bug that points to. A comparison whose allowance is half the quantity itself is reported as not
checkable, never as agreement; a PASS ends with its power: the smallest error in the rate, the weight decay,
the gradient scale and the clipping threshold it would have failed (power-json: the same as JSON).
--margins walks every step without stopping and prints each check's share of its allowance.

Exit status 0: theirs agrees at every step; 1: it does not (the first failure and its diagnosis are printed);
2: a trace cannot be read or the two contradict each other (one message naming the file and the field).
The last line is "N passed, M failed": one check per step and one per kept step's tensors.
Numpy and the standard library only (Debian's /usr/bin/python3). The allowances are in
tests/trace_tolerances.py, the diagnoses and the failing step's replay in tests/trace_diagnosis.py, a PASS's
power in tests/trace_power.py; this file reads the traces, walks the steps and reports.
"""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from trace_files import Trace, TraceError, is_int, rounded_to  # noqa: E402
# What a difference points to, and how far a difference may go (each a file of its own, beside this one).
from trace_diagnosis import (Diagnosis, ShardUpdates, diagnose_loss, diagnose_lr, diagnose_norm,  # noqa: E402
                             diagnose_parameters, diagnose_stale_shards, factor_diagnosis, named_line, replay_step)
from trace_power import Power  # noqa: E402 (what a PASS could not have seen)
from trace_tolerances import (CHECKABLE, UNIT, Allowances, allowance_header, gradient_tolerance,  # noqa: E402
                              is_finite_number, is_number, parameter_tolerances, relative_l2, same_setting, share)


class BadInput(Exception):
    """Two traces that cannot be compared: exit 2 with this message."""


class Failure(Exception):
    """The first disagreement: what differs, and the diagnosis."""

    def __init__(self, what, diagnosis, excess=None, census=None, first=None):
        super().__init__(what)
        # excess: difference / tolerance of the check, which fails by its worst element; first: that of the
        # tensor named in `what` (the first in registration order), where tensors were compared
        self.what, self.diagnosis, self.excess, self.first = what, diagnosis, excess, first
        self.census = census  # every tensor outside, in a line (census()), where tensors were compared
        # the class of tests/bug_taxonomy.py the diagnosis names (or the classes that fit): its "named:" line
        self.named, self.fits = getattr(diagnosis, "named", None), getattr(diagnosis, "fits", None)
        self.named_line = named_line(diagnosis)


# ----------------------------------------------------------------------------
# What the two traces must hold before a number of them is compared. Every field the checks below read is
# checked here first, so that a damaged or hand-made trace ends in one message naming its file and field
# (exit 2), never in a Python traceback or, worse, in a comparison that silently compares less.

def require(condition, path, field, value, want):
    if not condition:
        raise BadInput(f"{path}: {field} is {brief(value)}, not {want}")


def brief(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_reference(ref):
    """zero2's trace: everything the checker reads from it, each field's type and range. The reference sets
    every tolerance, so a NaN or an Inf in it would make a tolerance NaN (0 x inf) and every comparison with
    it false: a NaN anywhere the checker reads is refused here."""
    path = ref.path
    if not ref.steps:
        raise BadInput(f"{path}: steps is empty: zero2's trace has no step to compare")
    if not ref.parameter_steps:
        raise BadInput(f"{path}: parameter_steps is empty: zero2's trace keeps no parameters to compare "
                       f"(train_bert_mini --trace keeps step 1's always)")
    run, optimizer = ref.run, ref.optimizer
    for key in ("world_size", "accumulation_steps", "micro_batch", "seq"):
        value = run.get(key)
        require(is_int(value) and value >= 1, path, f"run.{key}", value, "a positive integer")
    require(run.get("precision") in UNIT, path, "run.precision", run.get("precision"), f"one of {sorted(UNIT)}")
    require(is_finite_number(run.get("dropout", 0)), path, "run.dropout", run.get("dropout"), "a number")
    betas = optimizer.get("betas")
    require(isinstance(betas, list) and len(betas) == 2 and all(is_finite_number(b) and 0 <= b < 1 for b in betas),
            path, "optimizer.betas", betas, "two numbers in [0, 1)")
    for key in ("eps", "weight_decay", "clip"):
        require(is_finite_number(optimizer.get(key)), path, f"optimizer.{key}", optimizer.get(key), "a finite number")
    require(isinstance(optimizer.get("bias_correction"), bool), path, "optimizer.bias_correction",
            optimizer.get("bias_correction"), "true or false")
    no_decay = optimizer.get("no_weight_decay")
    require(isinstance(no_decay, list) and all(isinstance(n, str) for n in no_decay), path,
            "optimizer.no_weight_decay", no_decay, "a list of tensor names")
    validate_layout(path, ref.layout, run["world_size"])
    for k, record in enumerate(ref.steps):
        where = f"steps[{k}]"
        require(is_finite_number(record.get("lr")) and record["lr"] >= 0, path, f"{where}.lr", record.get("lr"),
                "a finite, non-negative number")
        skipped = record.get("skipped", False)
        require(isinstance(skipped, bool), path, f"{where}.skipped", skipped, "true or false")
        for key in ("loss", "grad_norm"):
            value = record.get(key)
            if skipped:  # an fp16 overflow: zero2 writes null
                require(value is None or is_number(value), path, f"{where}.{key}", value, "a number or null")
            elif not is_finite_number(value):
                raise BadInput(f"{path}: {where}.{key} is {brief(value)} on a step zero2 did not skip: "
                               + ("the reference diverged there; trace a run that trains" if is_number(value)
                                  else "not a finite number"))
        losses, selected = record.get("micro_batch_losses"), record.get("micro_batch_selected")
        if losses is not None or selected is not None:  # the loss's diagnosis reads them
            require(isinstance(losses, list) and all(is_finite_number(x) for x in losses), path,
                    f"{where}.micro_batch_losses", losses, "a list of finite numbers")
            require(isinstance(selected, list) and len(selected) == len(losses)
                    and all(is_int(c) and c >= 0 for c in selected), path, f"{where}.micro_batch_selected",
                    selected, "a list of counts, one per micro-batch")
        if "selected" in record:
            require(is_int(record["selected"]) and record["selected"] >= 0, path, f"{where}.selected",
                    record["selected"], "a count")
        if "betas" in record:  # a scheduler's betas of the update (DeepSpeed's OneCycle): the replay reads them
            step_betas = record["betas"]
            require(isinstance(step_betas, list) and len(step_betas) == 2
                    and all(is_finite_number(b) and 0 <= b < 1 for b in step_betas), path, f"{where}.betas",
                    step_betas, "two numbers in [0, 1)")


def validate_layout(path, layout, world_size):
    """zero2's layout at N: every parameter inside its bucket, every bucket N shards of a positive length
    inside the padded buffer. where() and shard_views() index by these numbers."""
    if layout is None:
        raise BadInput(f"{path}: no field layout: REF must be zero2's own trace (train_bert_mini --trace)")
    require(isinstance(layout, dict), path, "layout", layout, "an object")
    psi_padded = layout.get("psi_padded")
    require(is_int(psi_padded) and psi_padded >= 0, path, "layout.psi_padded", psi_padded, "a count")
    buckets, parameters = layout.get("buckets"), layout.get("parameters")
    require(isinstance(buckets, list) and buckets, path, "layout.buckets", buckets, "a list of buckets")
    require(isinstance(parameters, list) and parameters, path, "layout.parameters", parameters,
            "a list of parameters")
    for b, bucket in enumerate(buckets):
        where = f"layout.buckets[{b}]"
        require(isinstance(bucket, dict), path, where, bucket, "an object")
        for key in ("offset", "length", "padded_length", "shard_length"):
            require(is_int(bucket.get(key)) and bucket[key] >= 0, path, f"{where}.{key}", bucket.get(key), "a count")
        require(bucket["shard_length"] > 0, path, f"{where}.shard_length", bucket["shard_length"],
                "a positive count (each rank owns one shard of every bucket)")
        require(bucket["padded_length"] == world_size * bucket["shard_length"]
                and bucket["length"] <= bucket["padded_length"]
                and bucket["offset"] + bucket["padded_length"] <= psi_padded, path, f"{where}.padded_length",
                bucket["padded_length"], f"N x shard_length (N = {world_size}), at least length, inside psi_padded")
    names = set()
    for k, p in enumerate(parameters):
        where = f"layout.parameters[{k}]"
        require(isinstance(p, dict), path, where, p, "an object")
        require(isinstance(p.get("name"), str) and p["name"] not in names, path, f"{where}.name", p.get("name"),
                "a tensor name given once")
        names.add(p["name"])
        shape = p.get("shape")
        require(isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape), path, f"{where}.shape", shape,
                "a list of non-negative integers")
        numel = 1
        for d in shape:
            numel *= d
        require(p.get("numel") == numel and is_int(p.get("numel")), path, f"{where}.numel", p.get("numel"),
                f"its shape's element count ({numel})")
        require(is_int(p.get("bucket")) and 0 <= p["bucket"] < len(buckets), path, f"{where}.bucket",
                p.get("bucket"), f"a bucket's index (0 .. {len(buckets) - 1})")
        bucket = buckets[p["bucket"]]
        require(is_int(p.get("offset")) and bucket["offset"] <= p["offset"]
                and p["offset"] + numel <= bucket["offset"] + bucket["length"], path, f"{where}.offset",
                p.get("offset"), f"an offset inside bucket {p['bucket']}")
        require(isinstance(p.get("decay", True), bool), path, f"{where}.decay", p.get("decay"), "true or false")


def validate_theirs(pair):
    """A peer's trace: its sections' types (Trace checked they are objects), its records' fields (numbers, or
    null where it had none; a NaN written as NaN is a finding, compared in the walk), and that it keeps at
    least one of zero2's kept steps: a trace with nothing to compare agrees with nothing."""
    theirs, path = pair.theirs, pair.theirs.path
    no_decay = theirs.optimizer.get("no_weight_decay")
    require(no_decay is None or (isinstance(no_decay, list) and all(isinstance(n, str) for n in no_decay)), path,
            "optimizer.no_weight_decay", no_decay, "a list of tensor names")
    for k, record in enumerate(theirs.steps[:len(pair.ref.steps)]):
        for key in ("loss", "grad_norm", "lr"):
            if key not in record:
                raise BadInput(f"{path}: steps[{k}].{key} is missing (step {k + 1})")
            if record[key] is not None and not is_number(record[key]):
                raise BadInput(f"{path}: steps[{k}].{key} is {brief(record[key])}, not a number")
        require(isinstance(record.get("skipped", False), bool), path, f"steps[{k}].skipped", record.get("skipped"),
                "true or false")
    if not set(pair.ref.parameter_steps) & set(theirs.parameter_steps):
        raise BadInput(f"{path}: parameter_steps keeps {sorted(theirs.parameter_steps) or 'no step'}, zero2's trace "
                       f"{sorted(pair.ref.parameter_steps)}: no kept step in common, so no parameter would be "
                       f"compared (keep the parameters at the steps zero2's trace lists)")


def validate_twin(pair):
    """The twin (REF/twin, or --twin DIR): zero2's own trace of the same run, differing only in legitimate
    rounding (tests/peers/reference_trace.sh makes it). It sets allowances, so it must be that run: the same
    model, batch, optimizer, steps and rates, and finite where it is read."""
    twin, ref, path = pair.twin, pair.ref, pair.twin.path
    if twin.layout is None or twin.producer != ref.producer:
        raise BadInput(f"{path}: producer is {brief(twin.producer)}, zero2's trace {brief(ref.producer)}: the twin "
                       f"must be zero2's own trace of the same run (tests/peers/reference_trace.sh makes it)")
    for section, keys in (("model", ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "intermediate_size")),
                          ("run", ("world_size", "accumulation_steps", "micro_batch", "seq", "precision", "steps",
                                   "dropout", "seed")),
                          ("optimizer", ("betas", "eps", "weight_decay", "clip"))):
        for key in keys:
            mine, theirs = ref.json[section].get(key), twin.json[section].get(key)
            if not same_setting(mine, theirs):
                raise BadInput(f"{path}: {section}.{key} is {brief(theirs)}, zero2's trace has {brief(mine)}: not a "
                               f"twin of this run")
    if len(twin.steps) != len(ref.steps):
        raise BadInput(f"{path}: steps has {len(twin.steps)} records, zero2's trace {len(ref.steps)}")
    for k, (mine, theirs) in enumerate(zip(ref.steps, twin.steps)):
        if not same_setting(mine.get("lr"), theirs.get("lr")):
            raise BadInput(f"{path}: steps[{k}].lr is {brief(theirs.get('lr'))}, zero2's {brief(mine.get('lr'))}: "
                           f"not a twin of this run")
        for key in ("loss", "grad_norm"):
            if not mine.get("skipped") and not is_finite_number(theirs.get(key)):
                raise BadInput(f"{path}: steps[{k}].{key} is {brief(theirs.get(key))}, not a finite number")


# ----------------------------------------------------------------------------
# The two traces side by side

class Pair:
    def __init__(self, ref, theirs, twin=None):
        self.ref, self.theirs, self.twin = ref, theirs, twin
        validate_reference(ref)
        self.precision = ref.run["precision"]
        self.N = ref.run["world_size"]
        self.A = ref.run["accumulation_steps"]
        self.layout = ref.layout
        self.params = {p["name"]: p for p in self.layout["parameters"]}
        self.no_decay = set(ref.optimizer["no_weight_decay"])
        # The reductions the tolerances cover (notes/12, "Tolerances"): the squares of every gradient element
        # (the norm), the selected positions' cross-entropies (the loss, per step), the positions of the
        # global batch whose products make each gradient element.
        self.psi = sum(p["numel"] for p in self.layout["parameters"])
        self.positions = self.N * self.A * ref.run["micro_batch"] * ref.run["seq"]
        self._read = {}
        self.uncheckable = {}  # step -> [(tensor, allowance)] whose gradient comparison sees nothing
        self.power = Power(self)
        self.shares = {}  # step -> {check: its share of the allowance} (--margins)
        # The tensors whose gradient is rounding noise, from the kept steps up to the one the walk reached
        # (advance): a later step never changes an earlier step's verdict.
        self.noise, self._quiet_seen = set(), None
        if twin is not None:
            validate_twin(self)
        self.allowances = Allowances(ref, twin, self.tensors, self.psi, self.precision, self.positions)

    def advance(self, step, kind=None):
        """The walk reached `step` (kind None: its record; "gradients", "parameters": its kept tensors of that
        kind): the twin's spread and the noise tensors up to it."""
        self.allowances.advance(step, kind)
        if kind == "gradients" and self.ref.parameter_steps.get(step):
            quiet = self.quiet_tensors(step)
            if quiet is not None:
                self._quiet_seen = quiet if self._quiet_seen is None else self._quiet_seen & quiet
                self.noise = set(self._quiet_seen)

    def selected(self, step):
        """The cross-entropies the loss of `step` sums: zero2's count of selected positions, or every position
        of the global batch where the record has none."""
        return self.ref.steps[step - 1].get("selected", self.positions)

    def quiet_tensors(self, step):
        """The tensors whose gradient is rounding noise in zero2's trace at kept `step` (every element below 1e-6
        of the model's largest), or None where the step says nothing (not kept, an fp16 overflow). An attention
        key's bias, which softmax ignores (a constant added to a row of scores), has a gradient that is exactly 0
        in exact arithmetic. AdamW turns noise into steps of about lr in a direction rounding decides, in zero2
        and in any other implementation, so while a tensor has been quiet at every kept step so far it is held
        only to AdamW's bound (the largest tolerance), not to the median nor to zero2's movement. The bound 1e-6
        lies between the noise and the smallest real gradient in every precision (measured on
        tests/peers/reference_trace.sh's model: the key biases at 1e-10 of the largest in fp32, 1.8e-7 in bf16,
        whose products are rounded to 8 bits; the next tensor, a query bias, at 3e-5 in both)."""
        gradients = self.tensors("ref", "gradients", step)
        if gradients is None or self.ref.steps[step - 1].get("skipped"):
            return None
        largest = max(float(np.abs(g).max()) for g in gradients.values())
        if not math.isfinite(largest):
            return None  # an fp16 step that overflowed: its gradient says nothing of noise
        return {n for n, g in gradients.items() if float(np.abs(g).max()) <= 1e-6 * largest}

    def start_rounding(self, name):
        """The median |16-bit(initial) - initial| of a tensor's elements: how far a peer whose fp32 master starts
        from its 16-bit model (DeepSpeed's does) starts from zero2's initial weights; 0 in fp32."""
        if self.precision == "fp32":
            return 0.0
        if not hasattr(self, "_start_rounding"):
            initial = self.tensors("ref", "parameters", 0)
            self._start_rounding = {n: float(np.median(np.abs(rounded_to(v, self.precision) - v)))
                                    for n, v in initial.items()}
        return self._start_rounding[name]

    def tensors(self, side, kind, step):
        """{name: float64 array} of zero2's ("ref") or their ("theirs") parameters or gradients after `step`
        (parameters at 0: zero2's initial weights), every tensor of zero2's layout present with its shape and
        finite, or None where that side did not keep them. A damaged reference is bad input (exit 2); a
        non-finite element of theirs is their first failure, named by file, tensor and element (numpy's
        comparisons with NaN are all false: a NaN would pass every tolerance unless looked for)."""
        key = (side, kind, step)
        if key not in self._read:
            trace = {"ref": self.ref, "theirs": self.theirs, "twin": self.twin}[side]
            values = trace.parameters(step) if kind == "parameters" else trace.gradients(step)
            file = os.path.join(trace.directory, "initial" if step == 0 else f"step_{step}",
                                "model.safetensors" if kind == "parameters" else "gradients.safetensors")
            if values is not None:
                values = self.checked(values, side, kind, step, file)
            self._read[key] = values
        return self._read[key]

    def forget_before(self, step):
        """Drop what was read for steps before `step` (the walk needs only the last kept step's and the
        current one's: a long trace's every kept step would not fit in memory)."""
        self._read = {k: v for k, v in self._read.items() if k[2] >= step}

    def checked(self, values, side, kind, step, file):
        arrays = {}
        for name, p in self.params.items():  # registration order: the first bad tensor is named
            if name not in values:
                raise BadInput(f"{file}: no tensor {name}")
            if list(values[name].shape) != p["shape"]:
                raise BadInput(f"{file}: {name} has {list(values[name].shape)}, zero2's layout {p['shape']}")
            array = np.asarray(values[name], dtype=np.float64)
            finite = np.isfinite(array)
            overflowed = side != "theirs" and kind == "gradients" and self.ref.steps[step - 1].get("skipped")
            if not finite.all() and not overflowed:
                i = int(np.argmin(finite.reshape(-1)))
                value = array.reshape(-1)[i]
                if side != "theirs":
                    raise BadInput(f"{file}: {self.where(name, i)} is {value}: zero2's trace must be finite where "
                                   f"it is compared (a reference that diverged sets no tolerance)")
                raise Failure(f"{'parameters after' if kind == 'parameters' else 'gradients of'} step {step}, "
                              f"{self.where(name, i)}: theirs is {value} ({file}; "
                              f"{int((~finite).sum())} of its {finite.size} elements are not finite)",
                              "theirs diverged, or a value was never written: the first non-finite element is here",
                              math.inf)
            arrays[name] = array
        return arrays

    def check_settings(self):
        """The two must describe one run: the model, the batch and the optimizer theirs used."""
        if self.ref.run.get("dropout", 0) != 0:
            raise BadInput(f"{self.ref.path}: run.dropout is {self.ref.run['dropout']}: zero2's dropout masks come "
                           f"from its own hash, which no other implementation draws; trace a run with --dropout 0")
        for section, keys in (("model", ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size", "max_position_embeddings")),
                              ("run", ("world_size", "accumulation_steps", "micro_batch", "seq", "precision")),
                              ("optimizer", ("betas", "eps", "weight_decay", "bias_correction", "clip"))):
            for key in keys:
                mine = self.ref.field(section, key)
                try:
                    theirs = self.theirs.json[section][key]
                except (KeyError, TypeError):
                    continue  # a peer need not repeat every setting
                if not same_setting(mine, theirs):
                    raise BadInput(f"{self.theirs.path}: {section}.{key} is {theirs!r}, zero2's trace has {mine!r}: "
                                   f"not a replay of this run")
        validate_theirs(self)
        theirs_no_decay = self.theirs.optimizer.get("no_weight_decay")
        if theirs_no_decay is not None and set(theirs_no_decay) != self.no_decay:
            raise BadInput(f"{self.theirs.path}: optimizer.no_weight_decay names other tensors than zero2's trace "
                           f"({sorted(set(theirs_no_decay) ^ self.no_decay)[:3]} ...)")
        if len(self.theirs.steps) < len(self.ref.steps):
            raise BadInput(f"{self.theirs.path}: steps has {len(self.theirs.steps)} records, zero2's trace "
                           f"{len(self.ref.steps)}: step {len(self.theirs.steps) + 1} is missing")

    # --- ZeRO's terms: where a flat element lies ----------------------------------------------------------

    def where(self, name, index):
        """'parameter[i] (bucket b, rank r's shard at N)' of element `index` of parameter `name`."""
        p = self.params[name]
        flat = p["offset"] + int(index)
        bucket = self.layout["buckets"][p["bucket"]]
        rank = (flat - bucket["offset"]) // bucket["shard_length"]
        return f"{name}[{np.unravel_index(int(index), p['shape']) if len(p['shape']) > 1 else int(index)}] " \
               f"(bucket {p['bucket']}, rank {rank}'s shard at N = {self.N})"

    def shard_views(self, values):
        """{(bucket, rank): flat values of that shard} of named tensors laid out as zero2 does at N."""
        flat = np.zeros(self.layout["psi_padded"], dtype=np.float64)
        for name, p in self.params.items():
            flat[p["offset"]:p["offset"] + p["numel"]] = np.asarray(values[name], dtype=np.float64).reshape(-1)
        shards = {}
        for b, bucket in enumerate(self.layout["buckets"]):
            for r in range(self.N):
                begin = bucket["offset"] + r * bucket["shard_length"]
                shards[(b, r)] = flat[begin:begin + bucket["shard_length"]]  # padding is zero on both sides
        return shards


# ----------------------------------------------------------------------------
# The walk through the steps

def check_step_scalars(pair, step, report, kept):
    """The step's record: no NaN, the rate, fp16's skip; then, at a step both keep, the gradients (where a bug
    confined to a bucket, a parameter or a rank shows by name, before the loss and the norm, which sum every
    element and show only that something differs); then the loss and the norm. Returns check_gradients' result
    (None where the gradients were not compared)."""
    mine, theirs = pair.ref.steps[step - 1], pair.theirs.steps[step - 1]
    for key in ("lr", "loss", "grad_norm"):  # NaN first: every comparison with a NaN is false, a NaN passes them
        value = theirs[key]
        skipped_both = mine.get("skipped") and theirs.get("skipped") and key != "lr"
        if not skipped_both and (value is None or not math.isfinite(value)):
            raise Failure(f"step {step}, {key.replace('_', ' ')}: theirs is {value} ({pair.theirs.path}: "
                          f"steps[{step - 1}].{key}), zero2's {mine[key]!r}",
                          "theirs diverged (or never computed it): the first non-finite value is here", math.inf)
    if not same_setting(mine["lr"], theirs["lr"]):
        raise Failure(f"step {step}, learning rate: theirs {theirs['lr']!r}, zero2's {mine['lr']!r}",
                      diagnose_lr(pair, step, theirs["lr"], mine["lr"]))
    if mine.get("skipped") or theirs.get("skipped"):
        if bool(mine.get("skipped")) != bool(theirs.get("skipped")):
            scales = (mine.get("loss_scale"), theirs.get("loss_scale"))
            raise Failure(f"step {step}: {'zero2' if mine.get('skipped') else 'theirs'} skipped it (an fp16 overflow), "
                          f"the other did not (loss scales: zero2's {scales[0]}, theirs {scales[1]})",
                          "the loss scales differ: compare steps[].loss_scale from step 1 on"
                          if not same_setting(*scales) else
                          "at the same loss scale one side's gradient overflowed and the other's did not: a sum of "
                          "the ranks' scaled 16-bit gradients before dividing by N overflows where each rank's "
                          "part does not (zero2 sums the 16-bit slices in fp32 and rounds once)")
        report.append((step, "skipped by both (fp16 overflow)", 0.0))
        return None
    if kept:
        pair.advance(step, "gradients")  # the twin's spread of this step's gradients, the noise tensors so far
    gradients = check_gradients(pair, step) if kept else None
    tolerances = {"loss": pair.allowances.scalar("loss", mine["loss"], step, pair.selected(step)),
                  "grad_norm": pair.allowances.scalar("grad_norm", mine["grad_norm"], step, pair.psi)}
    for key, diagnose in (("loss", diagnose_loss), ("grad_norm", diagnose_norm)):
        value, tolerance = theirs[key], tolerances[key]
        if abs(value - mine[key]) > tolerance:
            raise Failure(f"step {step}, {key.replace('_', ' ')}: theirs {value:.9g}, zero2's {mine[key]:.9g} "
                          f"(|difference| {abs(value - mine[key]):.3g} > allowance {tolerance:.3g})"
                          + ("; the gradients of this step agree" if gradients is not None else ""),
                          diagnose(pair, step, value, mine[key], gradients is not None),
                          share(abs(value - mine[key]), tolerance))
    if mine["grad_norm"]:
        pair.power.smallest("grad_scale", tolerances["grad_norm"] / abs(mine["grad_norm"]), f"step {step}, the norm")
    pair.shares.setdefault(step, {}).update(
        {key: share(abs(theirs[key] - mine[key]), tolerances[key]) for key in ("loss", "grad_norm")})
    relative = {key: abs(theirs[key] - mine[key]) / abs(mine[key]) if mine[key] else 0.0 for key in ("loss", "grad_norm")}
    report.append((step, f"loss {mine['loss']:.7f} / {theirs['loss']:.7f} (relative {relative['loss']:.1e}), "
                         f"grad norm {mine['grad_norm']:.6g} / {theirs['grad_norm']:.6g} "
                         f"(relative {relative['grad_norm']:.1e}), lr {mine['lr']:.4g}",
                   max(share(abs(theirs[key] - mine[key]), tolerances[key]) for key in ("loss", "grad_norm"))))
    return gradients


def census(pair, outside, what):
    """One line on every tensor outside its tolerance (not only the first): how many, the worst and its
    margin, and which buckets and ranks' shards hold their differing elements. outside: [(name, share,
    flat indices of its elements outside, element of its largest difference)]."""
    worst = max(outside, key=lambda entry: entry[1])
    places = {(pair.params[name]["bucket"],
               (pair.params[name]["offset"] + int(i) - pair.layout["buckets"][pair.params[name]["bucket"]]["offset"])
               // pair.layout["buckets"][pair.params[name]["bucket"]]["shard_length"])
              for name, _, indices, _ in outside for i in indices}
    return (f"{len(outside)} of {len(pair.params)} tensors' {what} outside the allowance; the worst "
            f"{pair.where(worst[0], worst[3])} ({worst[1]:.3g} x its tolerance); buckets "
            f"{sorted({b for b, _ in places})}, ranks {sorted({r for _, r in places})} at N = {pair.N}")


def check_gradients(pair, step):
    """The step's gradients, tensor by tensor: |theirs - zero2|_2 / |zero2|_2 against the tensor's allowance
    (Allowances.gradient: the twin's spread and the floor). A tensor whose allowance is CHECKABLE (half) of its
    own size or more is not checkable at this precision (an attention key's bias, whose gradient is rounding
    noise; in 16-bit the tensors whose twin spreads as far): it is listed as such, never counted as agreeing.
    Returns (the worst share, the largest relative difference of a checkable tensor, what was not checkable),
    or None where the gradients were not compared."""
    if pair.ref.steps[step - 1].get("skipped"):
        return None  # an fp16 overflow: zero2's gradient is not finite there
    mine, theirs = pair.tensors("ref", "gradients", step), pair.tensors("theirs", "gradients", step)
    if mine is None or theirs is None:
        return None  # not kept on one side
    worst, largest_relative, outside, uncheckable = 0.0, 0.0, [], []
    for name in pair.params:  # registration order: the first tensor that differs is named
        allowance, relative = pair.allowances.gradient(name), relative_l2(mine[name], theirs[name])
        if name in pair.noise:  # rounding noise in zero2's own trace (Pair.quiet_tensors): nothing to compare
            allowance = math.inf
        if allowance >= CHECKABLE:
            uncheckable.append((name, allowance))
            continue
        excess = share(relative, allowance)
        worst, largest_relative = max(worst, excess), max(largest_relative, relative)
        pair.power.smallest("grad_scale", allowance, f"step {step}, the gradient of {name}")
        if excess > 1:
            difference = np.abs(mine[name] - theirs[name]).reshape(-1)
            scale = float(np.sqrt(np.mean(mine[name] ** 2)))
            outside.append((name, excess, np.flatnonzero(difference > allowance * max(scale, 1e-300)),
                            int(difference.argmax())))
    pair.uncheckable[step] = uncheckable
    pair.shares.setdefault(step, {})["gradients"] = worst
    unseen = "" if not uncheckable else \
        f"; not checkable at {pair.precision}: {len(uncheckable)} tensor{'s' if len(uncheckable) > 1 else ''} " \
        f"({uncheckable[0][0]}{' ...' if len(uncheckable) > 1 else ''}: " + \
        ("rounding noise in zero2's trace)" if not math.isfinite(uncheckable[0][1]) else
         f"allowance {uncheckable[0][1]:.2g} of its norm)")
    if outside:
        name, excess, _, i = outside[0]
        a, b = mine[name].reshape(-1), theirs[name].reshape(-1)
        relative, allowance = relative_l2(mine[name], theirs[name]), pair.allowances.gradient(name)
        what = (f"step {step}, gradient of {name}: |theirs - zero2's| is {relative:.3g} of its norm (allowance "
                f"{allowance:.3g}); its largest difference at {pair.where(name, i)}: theirs {b[i]:.6g}, zero2's "
                f"{a[i]:.6g}")
        record, their_record = pair.ref.steps[step - 1], pair.theirs.steps[step - 1]
        loss_differs = abs(their_record["loss"] - record["loss"]) > \
            pair.allowances.scalar("loss", record["loss"], step, pair.selected(step))
        tolerance = element_tolerance(pair, step, mine)
        diagnosis, reproduced, kind = diagnose_gradients(pair, step, mine, theirs, tolerance,
                                                         [entry[0] for entry in outside], not loss_differs)
        if loss_differs:
            # The loss is what is differentiated: where it differs by a pattern that names its cause and the
            # whole gradient differs, that cause is the diagnosis; where the gradients differ in a region only,
            # both are said (a loss recorded wrong beside a bucket reduced wrong). At step 1, from the same
            # weights and batch, a loss that differs by no named pattern points to the forward pass.
            what += f"; the loss differs too: theirs {their_record['loss']:.9g}, zero2's {record['loss']:.9g}"
            named = diagnose_loss(pair, step, their_record["loss"], record["loss"], generic=False)
            if named and kind == "all":
                diagnosis = named + "; the gradients, its derivative, differ with it"
            elif named:
                diagnosis = diagnosis + f". The loss differs as well: {named}"
            elif not reproduced and step == 1:
                diagnosis = diagnose_loss(pair, step, their_record['loss'], record['loss']) + f". Measured: {diagnosis}"
        raise Failure(what, diagnosis, max(e[1] for e in outside), census(pair, outside, "gradients"), excess)
    return worst, largest_relative, unseen


def element_tolerance(pair, step, mine):
    """How far one gradient element may differ, for the diagnoses' element-wise tests (a region's shards, a
    factor, a stale buffer): the analytic bound against the largest element, no wider than the checkable
    tensors' allowances allow an element of the largest size."""
    largest = max(float(np.abs(v).max(initial=0.0)) for v in mine.values())
    allowed = [pair.allowances.gradient(n) for n in pair.params if pair.allowances.gradient(n) < CHECKABLE]
    cap = (sorted(allowed)[len(allowed) // 2] if allowed else CHECKABLE) * largest
    return min(gradient_tolerance(largest, step, pair.precision, pair.positions), cap)


def gradient_region(pair, off, silent):
    """(where, kind): where the shards outside the tolerance (off) lie, in ZeRO's terms: kind "all" (every
    bucket and every rank), "buckets" (some buckets, on every rank), "ranks" (some ranks, in every bucket), or
    "shards" (a list). silent: the shards whose gradient is below the tolerance on both sides, which agree
    whatever was done to them (rows of the position embeddings no position reaches): a region is whole when
    every shard of it that could differ does."""
    N, count = pair.N, len(pair.layout["buckets"])
    off = set(off)
    buckets, ranks = sorted({b for b, _ in off}), sorted({r for _, r in off})
    whole_buckets = all((b, r) in off or (b, r) in silent for b in buckets for r in range(N))
    whole_ranks = all((b, r) in off or (b, r) in silent for b in range(count) for r in ranks)

    def also(inside):  # the silent shards of the region, named
        quiet = sorted(k for k in silent if inside(k))
        return "" if not quiet else \
            f" ({', '.join(f'bucket {b} rank {r}' for b, r in quiet[:4])}{' ...' if len(quiet) > 4 else ''}: a " \
            f"gradient below the tolerance, which tells nothing)"
    if whole_buckets and whole_ranks and len(buckets) == count and len(ranks) == N:
        return "every bucket on every rank", "all"
    if whole_buckets and len(buckets) < count:
        names = [n for n, p in pair.params.items() if p["bucket"] in buckets]
        held = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        return (f"bucket{'s' if len(buckets) > 1 else ''} {', '.join(map(str, buckets))} of {count} ({held}) on "
                f"every rank, while the other buckets agree{also(lambda k: k[0] in buckets)}"), "buckets"
    if whole_ranks and len(ranks) < N:
        others = "the other ranks'" if N - len(ranks) > 1 else "the other rank's"
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}'s shards of every bucket, "
                f"while {others} agree{also(lambda k: k[1] in ranks)}"), "ranks"
    listed = ", ".join(f"bucket {b} rank {r}" for b, r in sorted(off)[:6]) + (" ..." if len(off) > 6 else "")
    return f"{len(off)} of {count * N} shards ({listed})", "shards"


def diagnose_gradients(pair, step, mine, theirs, tolerance, names, loss_agrees):
    """The gradients differ: (diagnosis, reproduced, kind). Where (gradient_region, whose kind is returned),
    and the hypothesis that reproduces theirs there element for element within the tolerance (reproduced
    True): zero (never reduced), a factor N, A or N A (summed where averaged, or averaged twice), zero2's
    gradient of the last kept step (stale), this step's plus that one (a buffer never zeroed). Where none
    does, what was measured over the tensors outside (names): theirs' least-squares slope on zero2's and the
    correlation. One hypothesis is named from them: where the step's loss agrees, a slope near 1 / N (or 1)
    that does not fit every element is what one rank's own micro-batches give alone, a reduction that never
    ran (measured, not reproduced: the traces hold no rank's own gradient). A forward pass that differs
    (another activation, another eps) also gives a slope near 1 with scatter, but its loss differs too."""
    shards_mine, shards_theirs = pair.shard_views(mine), pair.shard_views(theirs)
    off = sorted(k for k in shards_mine
                 if np.abs(shards_theirs[k] - shards_mine[k]).max(initial=0.0) > tolerance)
    silent = {k for k in shards_mine if max(np.abs(shards_mine[k]).max(initial=0.0),
                                            np.abs(shards_theirs[k]).max(initial=0.0)) <= tolerance}
    if not off:  # no element beyond the element-wise bound: the tensors differ as wholes, by small amounts
        off = sorted({(pair.params[n]["bucket"], r) for n in names for r in range(pair.N)})
    where, kind = gradient_region(pair, off, silent)
    a = np.concatenate([shards_mine[k] for k in off])
    t = np.concatenate([shards_theirs[k] for k in off])
    if np.abs(t).max(initial=0.0) <= tolerance:
        return Diagnosis(f"in {where}, theirs' gradients are zero: that reduction never ran, or its result never "
                         f"reached the gradient shard (a bucket whose last parameter's hook did not fire, or that was "
                         f"not flushed after backward; a rank that did not receive)",
                         {"buckets": "reduction.bucket-skipped", "ranks": "reduction.rank-shard-zero"}.get(kind)), \
            True, kind
    N, A = pair.N, pair.A
    for factor in sorted({f for f in (N, A, N * A) if f > 1}):
        for k in (factor, 1 / factor):
            if np.abs(t - k * a).max() <= max(k, 1.0) * tolerance:
                named = factor_diagnosis(pair, k)
                if named:
                    return (named if kind == "all" else f"in {where}, " + named), True, kind
    earlier = [s for s, kept_gradients in pair.ref.parameter_steps.items() if s < step and kept_gradients]
    old = pair.tensors("ref", "gradients", max(earlier)) if earlier else None
    if old is not None:
        s, old = max(earlier), pair.shard_views(old)
        before = np.concatenate([old[k] for k in off])
        if np.abs(t - before).max() <= tolerance:
            return Diagnosis(f"in {where}, theirs' gradients are zero2's of step {s}: stale, not recomputed or not "
                             f"reduced again at step {step} (a buffer reused without being overwritten, or a "
                             f"reduction that sent the last step's values)", "reduction.stale"), True, kind
        if s == step - 1 and np.abs(t - (a + before)).max() <= 2 * tolerance:
            return Diagnosis(f"in {where}, theirs' gradients are zero2's of this step plus those of step {s}: the "
                             f"gradient buffer was not zeroed after step {s}'s update, so this step's backward "
                             f"accumulated onto it", "accumulation.not-zeroed"), True, kind
    # Measured over the tensors outside (a region of whole shards would dilute one tensor's factor).
    a = np.concatenate([mine[n].reshape(-1) for n in names])
    t = np.concatenate([theirs[n].reshape(-1) for n in names])
    if not np.dot(a, a) > 0:
        return (f"in {where}, zero2's gradient is zero and theirs is not: theirs has gradient where no position of "
                f"the batch reaches (rows of an embedding no token or position selects)"), False, kind
    slope = float(np.dot(t, a) / np.dot(a, a))
    correlation = float(np.dot(t, a) / math.sqrt(np.dot(t, t) * np.dot(a, a))) if np.dot(t, t) > 0 else 0.0
    measured = (f"over the {len(names)} tensors outside, theirs is, at least squares, {slope:.3f} x zero2's, with "
                f"correlation {correlation:.3f} (1 would be a multiple of zero2's)")
    # One rank's part correlates with the mean of N parts at about 0.75 (N = 4) to 0.86 (N = 2) here (measured:
    # tests/peers/check_peer.sh's last-bucket-local), nearer 1 the more each rank's batch resembles the global
    # one; a gradient off by rounding-sized noise is above 0.98, one unrelated to zero2's below 0.5. Every rank
    # keeps its own part, so the region is whole buckets (or all): never some ranks' shards alone, which is a
    # stale shard the traces cannot reproduce (its step's gradient not kept).
    near = [k for k in (1 / N, 1.0) if abs(slope - k) < 0.25 * k] if N > 1 else []
    # A buffer that each micro-step overwrites keeps the last micro-step's part alone: a slope of 1 / A on
    # the whole gradient (every bucket), the loss agreeing (measured, as above: no trace holds a micro-step's).
    last = A > 1 and abs(slope - 1 / A) < 0.25 / A and loss_agrees and 0.5 < correlation < 0.98 and kind == "all"
    if last:
        overwrites = (f"in {where}, {measured}, and the loss agrees: what the last of the A = {A} micro-steps gives "
                      f"alone, whose slope on their sum is 1 / A in expectation: each micro-step's gradient replaced "
                      f"the buffer instead of adding to it (measured, not reproduced: the traces hold no micro-step's "
                      f"gradient)")
        if not near:
            return Diagnosis(overwrites, "accumulation.overwrites"), False, kind
        return Diagnosis(overwrites + "; or one rank's own micro-batches alone (that reduction did not run)",
                         fits=["accumulation.overwrites", "reduction.bucket-local"],
                         separate=f"the slope {slope:.3f} is near both 1 / A and 1 / N; a run with A = 1 (or N far "
                                  f"from A) tells them apart"), False, kind
    if near and loss_agrees and 0.5 < correlation < 0.98 and kind in ("all", "buckets"):
        divided = near[0] != 1.0
        return Diagnosis(f"in {where}, {measured}, and the loss agrees: what one rank's own micro-batches give alone "
                         f"(their part of the sum{', divided by N' if divided else ''}), whose slope on the mean of "
                         f"N = {N} ranks' parts is {'1 / N' if divided else '1'} in expectation: that reduction did "
                         f"not run and each rank kept its local gradient (measured, not reproduced: the traces hold "
                         f"no rank's own gradient)", "reduction.bucket-local"), False, kind
    return f"in {where}, {measured}; no known bug has this pattern", False, kind


def check_parameters(pair, step, previous):
    """The parameters after `step` against zero2's (the tolerances of parameter_tolerances), and each tensor's
    movement since `previous` (the last step both keep; 0: the initial weights) against zero2's movement.

    Why the movement. In bf16 and fp16 the element tolerance must admit one unit of the format at the
    tensor's size (a peer's fp32 master may start from its 16-bit copy), and AdamW moves an element by about
    lr a step: a LayerNorm weight near 1 moves by 1e-3 against bf16's unit there of 2^-7 = 0.0078. A peer
    that steps its 16-bit parameters (no fp32 master) rounds every such update away: those weights never
    move, and the element tolerance, 8 updates wide, cannot see it. The movement can: from the same start,
    theirs must move each tensor about as far as zero2 moved it: its median |change| per element between
    half and twice zero2's (with the fp32 median tolerance of the steps in between added on both sides).
    AdamW's step is about lr for every element with a gradient, whatever the gradient's size, so a correct
    peer's movement differs from zero2's by rounding, a small part of lr (measured in notes/12), while a peer
    that did not move a tensor at all, or moved it one step of two, is at half or less. The speed, not the
    element-wise difference of the movements: where a tensor's gradient is rounding noise (an attention
    key's bias in bf16, which the fp32 noise test does not catch) its direction is rounding's, its size AdamW's.
    So a tensor zero2 moved by whole updates and theirs did not fails, in every precision: a missing master
    copy, an update that never reached the weights, a step skipped between two adjacent kept steps.
    """
    mine, theirs = pair.tensors("ref", "parameters", step), pair.tensors("theirs", "parameters", step)
    pair.advance(step, "parameters")
    before = pair.tensors("ref", "parameters", previous)
    theirs_before = pair.tensors("theirs", "parameters", previous) if previous else None
    lrs = [pair.ref.steps[t - 1]["lr"] for t in range(1, step + 1)]
    update_largest = parameter_tolerances(sum(lrs), pair.precision)[1]  # AdamW's bound: analytic in every mode
    drift_between = parameter_tolerances(sum(lrs[previous:]), "fp32")[0]
    worst, outside, first, stalled, kinds = 0.0, [], None, {}, {}
    for name in pair.params:
        # In mixed precision one unit of the format more, at the tensor's size: a peer's fp32 master may start
        # from its 16-bit model (DeepSpeed's does), zero2's starts from the fp32 weights themselves.
        # The median: the start's own rounding (|16-bit(initial) - initial| of this tensor, exact: 0 for the
        # LayerNorm weights at 1), the largest: one unit at the tensor's size.
        size = np.abs(mine[name])
        start = UNIT[pair.precision] if pair.precision != "fp32" else 0.0
        largest_tolerance = update_largest + start * float(size.max(initial=0.0))
        difference = np.abs(theirs[name] - mine[name]).reshape(-1)
        largest = float(difference.max(initial=0.0))
        if pair.allowances.calibrated():
            # The median of the updates' difference since each side's start: zero2's from the initial weights,
            # theirs from them or, in 16-bit, from their rounding (a master made from the 16-bit model), the
            # nearer; the twin's spread is measured the same way (Allowances._tensor_spread).
            initial = pair.tensors("ref", "parameters", 0)[name]
            starts = [initial] + ([rounded_to(initial, pair.precision)] if pair.precision != "fp32" else [])
            median = min(float(np.median(np.abs((theirs[name] - s) - (mine[name] - initial)))) for s in starts)
            median_tolerance = pair.allowances.parameter_median(name, sum(lrs))
        else:
            median = float(np.median(difference))
            median_tolerance = pair.allowances.parameter_median(name, sum(lrs)) + pair.start_rounding(name)
        moved = float(np.median(np.abs(mine[name] - before[name])))
        if name in pair.noise:
            median, speed, movement_excess = 0.0, None, 0.0  # AdamW's bound alone (Pair.quiet_tensors)
        else:
            pair.power.parameters(step, name, median_tolerance, mine[name], pair.tensors("ref", "parameters", 0)[name],
                                  sum(lrs))
            # Theirs from its own previous kept step; from the start, theirs' start is zero2's initial weights
            # or, in 16-bit, their rounding (a master made from the 16-bit model): the one that makes theirs'
            # movement nearer zero2's counts.
            starts = [theirs_before[name]] if previous else \
                [before[name]] + ([rounded_to(before[name], pair.precision)] if pair.precision != "fp32" else [])
            speed, movement_excess = min((movement_share(float(np.median(np.abs(theirs[name] - s))), moved,
                                                         drift_between) for s in starts), key=lambda x: x[1])
        if movement_excess > 1:
            stalled.setdefault("worst", (movement_excess, name, moved, speed))
            stalled["worst"] = max(stalled["worst"], (movement_excess, name, moved, speed))
        parts = {"parameters, median": share(median, median_tolerance),
                 "parameters, largest": share(largest, largest_tolerance), "parameters, movement": movement_excess}
        for part, value in parts.items():
            kinds[part] = max(kinds.get(part, 0.0), value)
        excess = max(parts.values())
        worst = max(worst, excess)
        if excess > 1:
            far = np.flatnonzero(difference > largest_tolerance)
            if not len(far):  # off as a whole: every element that differs at all
                far = np.flatnonzero(difference > min(median_tolerance, median))
            outside.append((name, excess, far, int(difference.argmax())))
            if first is None:
                first = (name, median, median_tolerance, largest, largest_tolerance, moved, speed, movement_excess,
                         excess)
    pair.shares.setdefault(step, {}).update(kinds, parameters=worst)
    if first is None:
        return worst
    name, median, median_tolerance, largest, largest_tolerance, moved, moved_theirs, movement_excess, excess = first
    i = outside[0][3]
    since = f"step {previous}" if previous else "the initial weights"
    lr = pair.ref.steps[step - 1]["lr"]
    # In order of evidence: a hypothesis of AdamW (tests/peers/adamw_replay.py) that reproduces theirs element
    # for element where AdamW as the trace states it does not (a replay, not a pattern, so no pattern's rule
    # pre-empts it: missing weight decay leaves the rows no batch reaches where they were, which reads as a
    # bucket left out); then whole ranks' or buckets' shards stale (the movement would see only that some
    # tensors did not move); a tensor that did not move; the patterns (a shard offset, decay on the wrong
    # tensors), and what the replay measured.
    diagnosis, measured, shards = None, None, None
    if previous == step - 1:
        diagnosis, measured = replay_step(pair, step)
        if diagnosis is None:
            shards = ShardUpdates(pair, theirs, mine, before, median_tolerance)
            diagnosis = diagnose_stale_shards(pair, shards)
    if diagnosis is None and stalled:  # a tensor moved too little or too far (not only the first one named)
        _, still, still_moved, still_theirs = stalled["worst"]
        diagnosis = diagnose_movement(pair, outside, still_moved, still_theirs, still, since, mine, step, previous)
    if diagnosis is None and previous == step - 1:
        shards = shards or ShardUpdates(pair, theirs, mine, before, median_tolerance)
        diagnosis = diagnose_parameters(pair, step, theirs, mine, before, shards, lr,
                                        pair.ref.optimizer["weight_decay"], median_tolerance)
    raise Failure(f"parameters after step {step}, {pair.where(name, i)}: theirs "
                  f"{theirs[name].reshape(-1)[i]:.9g}, zero2's {mine[name].reshape(-1)[i]:.9g}; "
                  f"over {name}: median |difference| {median:.3g} (allowance {median_tolerance:.3g}), largest "
                  f"{largest:.3g} (allowance {largest_tolerance:.3g})"
                  + ("" if moved_theirs is None else
                     f"; moved since {since} (median |change| of an element): zero2 {moved:.3g}, theirs "
                     f"{moved_theirs:.3g} (admitted: {max(0.0, 0.5 * moved - drift_between):.3g} .. "
                     f"{2 * moved + drift_between:.3g})"),
                  (diagnosis or (f"{name} is the first tensor (registration order) outside the allowance"
                                 + ("" if previous == step - 1 else
                                    f"; the traces keep no parameters between steps {previous} and {step}: "
                                    f"keep every step's (--trace-params-every 1) to see the first update "
                                    f"that differs"))) + (f". {measured}" if measured else ""),
                  max(e[1] for e in outside), census(pair, outside, "parameters"), outside[0][1])


def movement_share(theirs, mine, drift):
    """(theirs, how far theirs' movement is outside [mine / 2 - drift, 2 mine + drift], as a share of that
    window's half-width on its side: 1 at its edge). theirs, mine: a tensor's median |change| per element
    since the last kept step."""
    slower = share(max(0.0, mine - theirs), 0.5 * mine + drift)
    faster = share(max(0.0, theirs - mine), mine + drift)
    return theirs, max(slower, faster)


def diagnose_movement(pair, outside, moved, moved_theirs, name, since, mine, step, previous):
    """Theirs did not move where zero2 moved: which tensors, and what that points to."""
    stuck = [n for n, *_ in outside]
    if moved_theirs > 0.25 * moved:
        return None
    if len(stuck) >= 0.9 * len([n for n in pair.params if n not in pair.noise]):
        return Diagnosis(f"theirs moved (almost) no parameter since {since} where zero2 moved them by about the "
                         f"learning rate a step: the update never reached the weights (the optimizer stepped a copy), "
                         f"or the step was skipped", "state.update-not-applied")
    if pair.precision != "fp32":
        unit = UNIT[pair.precision] * float(np.median(np.abs(mine[name])))
        return Diagnosis(f"theirs did not move {name} (and {len(stuck) - 1} more tensors) where zero2 moved it by "
                f"{moved:.3g} at the median, {moved / unit:.2g} of a {pair.precision} unit at its size "
                f"({unit:.3g}): an update smaller than the format's spacing is rounded away when the parameters "
                f"are stepped in {pair.precision}. Keep an fp32 master copy, step it, and round it to "
                f"{pair.precision} for the forward (zero2's trace holds the master)", "precision.no-master")
    return Diagnosis(f"theirs did not move {name} (and {len(stuck) - 1} more tensors) since {since}, where zero2 "
                     f"moved it by {moved:.3g} at the median: those parameters were left out of the update",
                     "state.group-not-updated")


def check(pair, counts, margins=None):
    """Every step in order, counting the checks passed in counts["passed"]; the first failure raised.
    Returns the report's lines. margins: a list that, where given, collects every step's failure instead
    (--margins: (step, Failure)), and the walk goes on."""
    report = []
    kept = sorted(s for s in pair.ref.parameter_steps if s in pair.theirs.parameter_steps)
    previous_kept = 0
    for step in range(1, len(pair.ref.steps) + 1):
        pair.advance(step)
        try:
            gradients = check_step_scalars(pair, step, report, step in kept)
            counts["passed"] += 1
        except Failure as failure:
            if margins is None:
                raise
            margins.append((step, failure))
            gradients = None
        if step in kept:
            try:
                worst_parameter = check_parameters(pair, step, previous_kept)
                report.append((step, f"after step {step}: {len(pair.params)} tensors: parameters"
                                     + ("" if gradients is None else
                                        f" and gradients (the largest relative difference {gradients[1]:.1e} of a "
                                        f"tensor's norm{gradients[2]})") + " within the allowance",
                               max(worst_parameter, gradients[0] if gradients else 0.0)))
                counts["passed"] += 1
            except Failure as failure:
                if margins is None:
                    raise
                margins.append((step, failure))
            pair.forget_before(step)  # the initial weights stay (step 0 is not before any)
            previous_kept = step
    return report


def describe(trace):
    run = trace.run
    kept = ", ".join(str(s) for s in sorted(trace.parameter_steps))
    return (f"N = {run['world_size']}, A = {run['accumulation_steps']}, stage {run.get('stage', '?')}, "
            f"{run['precision']}, {len(trace.steps)} steps; parameters after steps {kept}")


def parse_arguments(argv):
    """(ref, theirs, twin, flags) or None: REF THEIRS [--twin DIR | --no-twin] [--every-step] [--margins]."""
    flags, positional, twin, k = set(), [], "", 1
    while k < len(argv):
        a = argv[k]
        if a in ("--every-step", "--margins", "--no-twin"):
            flags.add(a)
        elif a == "--twin" and k + 1 < len(argv):
            twin, k = argv[k + 1], k + 1
        elif a.startswith("-"):
            return None
        else:
            positional.append(a)
        k += 1
    if len(positional) != 2:
        return None
    ref = positional[0]
    if not twin and "--no-twin" not in flags and os.path.isdir(os.path.join(ref, "twin")):
        twin = os.path.join(ref, "twin")  # tests/peers/reference_trace.sh writes it there
    return ref, positional[1], twin or None, flags


def print_margins(pair, failures):
    """--margins: every step's share of every allowance (1 = at its edge), the failures marked."""
    failed = {}
    for step, failure in failures:
        failed.setdefault(step, []).append(failure)
    print("margins (each check's worst share of its allowance; FAIL where it is above 1):")
    print(f"  {'step':>4}  {'loss':>9}  {'grad norm':>9}  {'gradients':>9}  {'parameters':>10}")
    for step in sorted(set(pair.shares) | set(failed)):
        row = pair.shares.get(step, {})
        cells = [f"{row[k]:9.3g}" if k in row else f"{'-':>9}" for k in ("loss", "grad_norm", "gradients")]
        cells.append(f"{row['parameters']:10.3g}" if "parameters" in row else f"{'-':>10}")
        marks = "".join(f"  FAIL {f.what}" for f in failed.get(step, []))
        print(f"  {step:4d}  {'  '.join(cells)}{marks}")


def main(argv):
    parsed = parse_arguments(argv)
    if parsed is None:
        print(__doc__.strip().split("\n\n")[1] if len(argv) > 1 else __doc__, file=sys.stderr)
        return 2
    ref_dir, theirs_dir, twin_dir, flags = parsed
    every_step = "--every-step" in flags  # a line per step, not only the first, the last and the kept ones
    counts = {"passed": 0}  # the checks made before a bad input stopped the walk count as made

    def bad_input(e):
        print(f"check_trace: error: {e}", file=sys.stderr)
        print(f"{counts['passed']} passed, 1 failed")
        return 2

    try:
        ref, theirs = Trace(ref_dir), Trace(theirs_dir)
        pair = Pair(ref, theirs, Trace(twin_dir) if twin_dir else None)
        pair.check_settings()
    except (TraceError, BadInput) as e:
        return bad_input(e)
    producer = theirs.producer if isinstance(theirs.producer, str) and len(theirs.producer) <= 200 else brief(theirs.producer)
    print(f"check_trace: {theirs_dir} ({producer}) against zero2's {ref_dir} ({describe(ref)})")
    print(allowance_header(pair))
    margins = [] if "--margins" in flags else None
    try:
        report = check(pair, counts, margins)
    except (BadInput, TraceError) as e:
        return bad_input(e)
    except Failure as failure:
        print_held_to_largest(pair)
        print(f"FAIL {failure.what}")
        if failure.excess is not None:
            first = "" if failure.first is None or failure.first == failure.excess else \
                f" (the worst tensor's; the one named above: {failure.first:.3g} x)"
            print(f"margin: the difference is {failure.excess:.3g} x its allowance{first}")
        if failure.census:
            print(f"census: {failure.census}")
        print(f"diagnosis: {failure.diagnosis or 'no known bug has this pattern; the difference is above'}")
        print(failure.named_line)
        print(f"{counts['passed']} passed, 1 failed")
        return 1
    print_held_to_largest(pair)
    if margins is not None:
        print_margins(pair, margins)
        if margins:
            step, failure = margins[0]
            print(f"FAIL {failure.what}")
            print(f"diagnosis: {failure.diagnosis or 'no known bug has this pattern; the difference is above'}")
            print(f"{counts['passed']} passed, {len(margins)} failed")
            return 1
    worst = max(report, key=lambda line: line[2] if math.isfinite(line[2]) else 0.0)
    kept = sorted(s for s in ref.parameter_steps if s in theirs.parameter_steps)
    for step, line, fraction in report:
        if every_step or step == 1 or step == len(ref.steps) or "after step" in line:
            print(f"  step {step:4d}  {line}  ({fraction:.2f} of the allowance)")
    if len(kept) < len(ref.parameter_steps):
        print(f"note: theirs keeps the parameters of {len(kept)} of zero2's {len(ref.parameter_steps)} kept steps; "
              f"only those were compared")
    unseen = sorted({name for entries in pair.uncheckable.values() for name, _ in entries})
    if unseen:
        print(f"not checkable at {pair.precision} (an allowance of half the quantity or more; never counted as "
              f"agreeing): the gradients of {', '.join(unseen[:4])}{' ...' if len(unseen) > 4 else ''} "
              f"({len(unseen)} tensors)")
    closest = {}
    for step, row in pair.shares.items():
        for check_name, value in row.items():
            if check_name != "parameters" and math.isfinite(value) and value >= closest.get(check_name, (-1, 0))[0]:
                closest[check_name] = (value, step)
    print("closest calls: " + ", ".join(f"{name.replace('grad_norm', 'grad norm')} {value:.2f} (step {step})"
                                        for name, (value, step) in sorted(closest.items(), key=lambda x: -x[1][0])))
    words, values = pair.power.report()
    print(f"PASS: theirs agrees with zero2 at all {len(ref.steps)} steps and {len(kept)} kept steps "
          f"(the closest call: step {worst[0]}, {worst[2]:.2f} of the allowance)")
    print(f"power: what this PASS could not have seen: {words}")
    print(f"power-json: {json.dumps(values, sort_keys=True)}")
    print(f"{counts['passed']} passed, 0 failed")
    return 0


def print_held_to_largest(pair):
    if pair.noise:
        print(f"held to the largest only (their gradient is rounding noise in zero2's trace at every kept step "
              f"so far): {', '.join(sorted(pair.noise))}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
