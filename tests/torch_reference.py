#!/usr/bin/python3
"""
torch_reference.py: an independent PyTorch reference for train_bert_mini.

What it is. A second, from-scratch implementation of the model we train
(Hugging Face BertForMaskedLM: byte-level vocab 260, learned positions, one
token type, post-LayerNorm blocks, erf GELU, MLM head tied to the word
embeddings) written with plain torch ops, plus torch.optim.AdamW. We use it to
check our C++/CUDA trainer from the outside: the trainer dumps the weights,
batch, loss and gradients of step 1 (--dump-batch) and the weights after that
step (--export-hf with --steps 1), and this script recomputes all of it and
says, per check, PASS or FAIL. It also times the same training step in torch,
so our tokens/s figure has a familiar yardstick.

What it leaves out. No dropout in the check (a random mask cannot be
reproduced across implementations, so we refuse such dumps), no attention
mask (our batches have no padding), no next-sentence head or pooler, no
token types other than 0. Mixed precision is checked by `mixed`: a bf16 or
fp16 dump's loss and gradients against fp64 on the same (16-bit) weights,
and a bf16 dump against torch.autocast("cpu", bfloat16) too. It does not
use `transformers` or the `safetensors` package: the model is ~60 lines below
and the file format ~60 more, so the reference depends on nothing but torch
and numpy, and shares no code with what it checks. (We validated the model
once against transformers.BertForMaskedLM on random weights; see the report
that came with this file, not a dependency.)

How to run (Debian's interpreter, which has torch and numpy):

    /usr/bin/python3 tests/torch_reference.py check DUMP_DIR AFTER_DIR
        DUMP_DIR  = ./train_bert_mini ... --dump-batch DUMP_DIR
        AFTER_DIR = ./train_bert_mini ... --steps 1 --export-hf AFTER_DIR
        (same flags and seed for both, --dropout 0)
    /usr/bin/python3 tests/torch_reference.py bench --layers 4 --hidden 256 \
        --heads 4 --intermediate 1024 --seq 128 --batch 16 --steps 10 --threads 2
    /usr/bin/python3 tests/torch_reference.py mixed DUMP_DIR
        DUMP_DIR  = ./train_bert_mini ... --precision bf16|fp16 --dropout 0 --dump-batch DUMP_DIR
    /usr/bin/python3 tests/torch_reference.py selftest

Exit status: 0 when every check passes, 1 when one fails, 2 on bad input
(missing file, malformed safetensors, a dump made with dropout, bad flags).
The last line of check and selftest is `N passed, M failed`.
"""

import json
import math
import os
import struct
import sys
import tempfile
import time

# bench --threads K must bind OpenBLAS too. Debian's torch does its GEMMs in
# the system OpenBLAS, which sizes its own thread pool from the environment
# when it is loaded, whatever torch.set_num_threads says later. So we read K
# before importing torch. And libgomp's threads spin after each parallel
# region, starving OpenBLAS's threads of the same cores: on a 2-core VM we
# measured 410 tokens/s spinning vs 1090 passive (BERT-mini, B=16, T=128),
# so unless the user says otherwise we make OpenMP wait passively.
if len(sys.argv) > 1 and sys.argv[1] == "bench":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for _i, _a in enumerate(sys.argv):
        if _a == "--threads" and _i + 1 < len(sys.argv):
            os.environ["OMP_NUM_THREADS"] = sys.argv[_i + 1]
            os.environ["OPENBLAS_NUM_THREADS"] = sys.argv[_i + 1]
        elif _a.startswith("--threads="):
            os.environ["OMP_NUM_THREADS"] = _a.split("=", 1)[1]
            os.environ["OPENBLAS_NUM_THREADS"] = _a.split("=", 1)[1]

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class BadInput(Exception):
    """Input we cannot check (missing file, malformed data, dropout on).
    Ends the run with a message and exit status 2, never a traceback."""


# ----------------------------------------------------------------------------
# safetensors, read and write
#
# Layout: u64 little-endian header length N, N bytes of JSON (padded with
# spaces to a multiple of 8), then the raw little-endian tensor bytes. The
# JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end]}
# (offsets relative to the end of the header), plus an optional
# "__metadata__" of string to string.

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
           "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
           "U8": "u1", "BOOL": "?"}
_NP_TO_ST = {np.dtype("float64"): "F64", np.dtype("float32"): "F32",
             np.dtype("float16"): "F16", np.dtype("int64"): "I64",
             np.dtype("int32"): "I32", np.dtype("int16"): "I16",
             np.dtype("int8"): "I8", np.dtype("uint8"): "U8",
             np.dtype("bool"): "BOOL"}


def read_safetensors(path):
    """Returns ({name: numpy array}, {metadata str: str}). BF16 comes back
    as float32 (numpy has no bfloat16); everything else keeps its dtype."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}")
    if len(blob) < 8:
        raise BadInput(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise BadInput(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: header is not JSON ({e})")
    if not isinstance(header, dict):
        raise BadInput(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(blob)[8 + n:]
    tensors = {}
    for name, info in header.items():
        try:
            dt, shape, (b, e) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: tensor {name!r} has a malformed header entry")
        if dt not in _DTYPES:
            raise BadInput(f"{path}: tensor {name!r} has unsupported dtype {dt}")
        npdt = np.dtype(_DTYPES[dt])
        count = int(np.prod(shape, dtype=np.int64))  # prod([]) = 1: a scalar
        if not (0 <= b <= e <= len(data)) or e - b != count * npdt.itemsize:
            raise BadInput(f"{path}: tensor {name!r} offsets [{b}, {e}) do not "
                           f"fit shape {shape} {dt} in {len(data)} data bytes")
        a = np.frombuffer(data[b:e], dtype=npdt).reshape(shape)
        if dt == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = a.astype(a.dtype.newbyteorder("="), copy=True)
    return tensors, meta


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: numpy array}. Writes names in sorted order, data
    contiguous, header padded with spaces to a multiple of 8 (so tensor data
    stays 8-byte aligned in a mapped file)."""
    header, chunks, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if a.dtype not in _NP_TO_ST:
            raise ValueError(f"cannot store dtype {a.dtype} ({name})")
        raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


# ----------------------------------------------------------------------------
# The model
#
# Modules are nested exactly like Hugging Face's so that named_parameters()
# yields the HF tensor names and a state dict maps 1:1 onto model.safetensors.
# The forward pass is written out by hand (our own attention, our own
# embedding sum) rather than calling nn.MultiheadAttention or transformers.

class Config:
    KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings", "layer_norm_eps")

    def __init__(self, d):
        missing = [k for k in self.KEYS if k not in d]
        if missing:
            raise BadInput(f"config.json lacks {', '.join(missing)}")
        self.V = int(d["vocab_size"])
        self.H = int(d["hidden_size"])
        self.L = int(d["num_hidden_layers"])
        self.NH = int(d["num_attention_heads"])
        self.F = int(d["intermediate_size"])
        self.P = int(d["max_position_embeddings"])
        self.TV = int(d.get("type_vocab_size", 1))
        self.raw = d
        self.eps = float(d["layer_norm_eps"])
        self.hidden_dropout = float(d.get("hidden_dropout_prob", 0.0))
        self.attn_dropout = float(d.get("attention_probs_dropout_prob", 0.0))
        act = d.get("hidden_act", "gelu")
        if act != "gelu":
            raise BadInput(f"config.json: hidden_act {act!r}; we implement only 'gelu' (erf)")
        if self.H % self.NH:
            raise BadInput(f"config.json: hidden_size {self.H} not divisible by "
                           f"num_attention_heads {self.NH}")
        if self.TV < 1:
            raise BadInput("config.json: type_vocab_size must be >= 1")

    def to_dict(self):
        return {"architectures": ["BertForMaskedLM"], "model_type": "bert",
                "vocab_size": self.V, "hidden_size": self.H,
                "num_hidden_layers": self.L, "num_attention_heads": self.NH,
                "intermediate_size": self.F, "max_position_embeddings": self.P,
                "type_vocab_size": self.TV, "layer_norm_eps": self.eps,
                "hidden_dropout_prob": self.hidden_dropout,
                "attention_probs_dropout_prob": self.attn_dropout,
                "hidden_act": "gelu",
                # HF builds word_embeddings with padding_idx = pad_token_id
                # (default 0) and then drops that row's lookup gradient: with
                # the default, byte 0 would get no gradient in HF. Our [PAD]
                # is 256 and never appears in a batch.
                "pad_token_id": 256}

    @staticmethod
    def load(d):
        path = os.path.join(d, "config.json")
        try:
            with open(path) as f:
                return Config(json.load(f))
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}")
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}: not JSON ({e})")


def _ns(**mods):
    m = nn.Module()
    for k, v in mods.items():
        setattr(m, k, v)
    return m


class BertMLM(nn.Module):
    def __init__(self, c, dropout=0.0):
        super().__init__()
        self.c, self.dropout = c, dropout
        H, F_ = c.H, c.F
        ln = lambda: nn.LayerNorm(H, eps=c.eps)
        self.bert = _ns(
            embeddings=_ns(word_embeddings=nn.Embedding(c.V, H),
                           position_embeddings=nn.Embedding(c.P, H),
                           token_type_embeddings=nn.Embedding(c.TV, H),
                           LayerNorm=ln()),
            encoder=_ns(layer=nn.ModuleList([_ns(
                attention=_ns(self=_ns(query=nn.Linear(H, H), key=nn.Linear(H, H),
                                       value=nn.Linear(H, H)),
                              output=_ns(dense=nn.Linear(H, H), LayerNorm=ln())),
                intermediate=_ns(dense=nn.Linear(H, F_)),
                output=_ns(dense=nn.Linear(F_, H), LayerNorm=ln()))
                for _ in range(c.L)])))
        # The decoder is the word-embedding matrix itself (tied), so it is not
        # a parameter here and autograd sums both uses into one gradient.
        self.cls = _ns(predictions=_ns(
            transform=_ns(dense=nn.Linear(H, H), LayerNorm=ln()),
            bias=nn.Parameter(torch.zeros(c.V))))

    def init_random(self, gen, std):
        """Normal(0, std) matrices, LayerNorm gains near 1, small random
        biases: random rather than HF's zero biases so that every gradient
        and every code path carries a signal in the selftest."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                if "LayerNorm.weight" in name:
                    p.copy_(1.0 + 0.1 * z)
                elif name.endswith("bias"):
                    p.copy_(0.1 * z)
                else:
                    p.copy_(std * z)

    def forward(self, ids, labels):
        c, e = self.c, self.bert.embeddings
        B, T = ids.shape
        D = c.H // c.NH
        drop = lambda t: F.dropout(t, self.dropout, self.training)
        x = (F.embedding(ids, e.word_embeddings.weight) + e.position_embeddings.weight[:T]
             + e.token_type_embeddings.weight[0])
        x = drop(F.layer_norm(x, (c.H,), e.LayerNorm.weight, e.LayerNorm.bias, c.eps))
        for blk in self.bert.encoder.layer:
            s = blk.attention.self
            heads = lambda t: t.view(B, T, c.NH, D).transpose(1, 2)   # B,NH,T,D
            q = heads(F.linear(x, s.query.weight, s.query.bias))
            k = heads(F.linear(x, s.key.weight, s.key.bias))
            v = heads(F.linear(x, s.value.weight, s.value.bias))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
            ctx = (drop(att) @ v).transpose(1, 2).reshape(B, T, c.H)
            o = blk.attention.output
            a = drop(F.linear(ctx, o.dense.weight, o.dense.bias))
            x = F.layer_norm(x + a, (c.H,), o.LayerNorm.weight, o.LayerNorm.bias, c.eps)
            h = F.gelu(F.linear(x, blk.intermediate.dense.weight, blk.intermediate.dense.bias))
            o = blk.output
            h = drop(F.linear(h, o.dense.weight, o.dense.bias))
            x = F.layer_norm(x + h, (c.H,), o.LayerNorm.weight, o.LayerNorm.bias, c.eps)
        p = self.cls.predictions
        t = p.transform
        h = F.gelu(F.linear(x, t.dense.weight, t.dense.bias))
        h = F.layer_norm(h, (c.H,), t.LayerNorm.weight, t.LayerNorm.bias, c.eps)
        logits = h @ e.word_embeddings.weight.t() + p.bias
        return F.cross_entropy(logits.reshape(-1, c.V), labels.reshape(-1),
                               ignore_index=-100)


def expected_shapes(c):
    s = {"bert.embeddings.word_embeddings.weight": (c.V, c.H),
         "bert.embeddings.position_embeddings.weight": (c.P, c.H),
         "bert.embeddings.token_type_embeddings.weight": (c.TV, c.H),
         "bert.embeddings.LayerNorm.weight": (c.H,),
         "bert.embeddings.LayerNorm.bias": (c.H,)}
    for i in range(c.L):
        p = f"bert.encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key",
                  "attention.self.value", "attention.output.dense"):
            s[p + n + ".weight"], s[p + n + ".bias"] = (c.H, c.H), (c.H,)
        s[p + "intermediate.dense.weight"], s[p + "intermediate.dense.bias"] = (c.F, c.H), (c.F,)
        s[p + "output.dense.weight"], s[p + "output.dense.bias"] = (c.H, c.F), (c.H,)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            s[p + n + ".weight"], s[p + n + ".bias"] = (c.H,), (c.H,)
    s["cls.predictions.transform.dense.weight"] = (c.H, c.H)
    s["cls.predictions.transform.dense.bias"] = (c.H,)
    s["cls.predictions.transform.LayerNorm.weight"] = (c.H,)
    s["cls.predictions.transform.LayerNorm.bias"] = (c.H,)
    s["cls.predictions.bias"] = (c.V,)
    return s


def decays(name):
    """Weight decay on Linear weights and the three embedding tables; none on
    biases (cls.predictions.bias included) or LayerNorm parameters. The same
    split as HF's run_mlm.py and as our trainer."""
    return name.endswith(".weight") and "LayerNorm" not in name


def make_adamw(model, lr, betas, eps, wd):
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n)], "weight_decay": wd},
         {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps)


def model_from(c, weights, dtype=torch.float32):
    m = BertMLM(c)
    sd = {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in weights.items()}
    m.load_state_dict(sd, strict=True)
    return m.to(dtype)


# ----------------------------------------------------------------------------
# check

class Report:
    def __init__(self, prefix=""):
        self.prefix, self.passed, self.failed = prefix, 0, 0
        self.failed_names = []

    def line(self, s):
        print(self.prefix + s, flush=True)

    def result(self, ok, name, detail):
        self.line(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            self.failed_names.append(name)
        return ok


U = 2.0 ** -24          # unit roundoff of fp32
ASSUMED_CLIP_NORM_REL = 1e-5  # how far we allow our trainer's global norm off


def check(dump_dir, after_dir, rep):
    cfg = Config.load(dump_dir)
    weights, wmeta = read_safetensors(os.path.join(dump_dir, "model.safetensors"))
    batch, meta = read_safetensors(os.path.join(dump_dir, "batch.safetensors"))
    hp = {}
    for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "clip", "dropout"):
        try:
            hp[k] = float(meta[k])
        except KeyError:
            raise BadInput(f"{dump_dir}/batch.safetensors: __metadata__ lacks {k!r}")
        except ValueError:
            raise BadInput(f"{dump_dir}/batch.safetensors: __metadata__ {k}={meta[k]!r} "
                           "is not a number")
    if hp["dropout"] != 0.0:
        raise BadInput(f"the dump was made with dropout {meta['dropout']}; a dropout "
                       "mask cannot be reproduced here. Re-run with --dropout 0")
    for k in ("input_ids", "labels", "loss"):
        if k not in batch:
            raise BadInput(f"{dump_dir}/batch.safetensors lacks {k!r}")
    after_cfg = Config.load(after_dir)
    after, ameta = read_safetensors(os.path.join(after_dir, "model.safetensors"))

    # Not part of the math we check, but what decides whether
    # BertForMaskedLM.from_pretrained accepts the export and trains it as we
    # do (both seen with transformers 4.36): notes, not failures.
    for d, c, md in ((dump_dir, cfg, wmeta), (after_dir, after_cfg, ameta)):
        if md.get("format") != "pt":
            rep.line(f"note: {d}/model.safetensors: __metadata__ lacks \"format\": \"pt\"; "
                     "transformers' from_pretrained refuses such a file")
        if c.raw.get("pad_token_id") != 256:
            rep.line(f"note: {d}/config.json: pad_token_id is {c.raw.get('pad_token_id')} "
                     "(HF default 0), not 256: HF would give byte 0 no embedding gradient")
        if c.raw.get("model_type") != "bert":
            rep.line(f"note: {d}/config.json lacks \"model_type\": \"bert\" (AutoConfig needs it)")

    # layout: exactly the HF tensors, shapes from config.json, fp32; a gradient
    # for each; the same in AFTER_DIR.
    shapes = expected_shapes(cfg)
    problems = []
    for what, d, want_dt in (("model", weights, np.float32), ("after", after, np.float32)):
        for n in sorted(set(shapes) - set(d)):
            problems.append(f"{what} lacks {n}")
        for n in sorted(set(d) - set(shapes)):
            problems.append(f"{what} has unexpected {n}")
        for n in sorted(set(shapes) & set(d)):
            if tuple(d[n].shape) != shapes[n] or d[n].dtype != want_dt:
                problems.append(f"{what} {n} is {d[n].dtype}{list(d[n].shape)}, "
                                f"want float32{list(shapes[n])}")
    for n, shp in shapes.items():
        g = batch.get("grad." + n)
        if g is None:
            problems.append(f"batch lacks grad.{n}")
        elif tuple(g.shape) != shp or g.dtype != np.float32:
            problems.append(f"grad.{n} is {g.dtype}{list(g.shape)}, want float32{list(shp)}")
    extra = sorted(set(batch) - {"input_ids", "labels", "loss"} -
                   {"grad." + n for n in shapes})
    problems += [f"batch has unexpected {n}" for n in extra]
    ids, labels, loss_ours = batch["input_ids"], batch["labels"], batch["loss"]
    if ids.dtype != np.int64 or labels.dtype != np.int64 or ids.ndim != 2 \
            or labels.shape != ids.shape:
        problems.append(f"input_ids {ids.dtype}{list(ids.shape)} / labels "
                        f"{labels.dtype}{list(labels.shape)}: want int64 [B,T], same shape")
    elif ids.size and (ids.min() < 0 or ids.max() >= cfg.V):
        problems.append(f"input_ids outside [0, {cfg.V})")
    elif ids.shape[1] > cfg.P:
        problems.append(f"sequence {ids.shape[1]} > max_position_embeddings {cfg.P}")
    elif not ((labels == -100) | ((labels >= 0) & (labels < cfg.V))).all():
        problems.append("labels hold values other than -100 and [0, vocab)")
    elif not (labels != -100).any():
        problems.append("no position is selected (all labels -100)")
    if loss_ours.shape != () or loss_ours.dtype != np.float32:
        problems.append(f"loss is {loss_ours.dtype}{list(loss_ours.shape)}, want float32 []")
    if after_cfg.to_dict() != cfg.to_dict():
        problems.append("AFTER_DIR/config.json describes a different model")
    B, T = ids.shape if ids.ndim == 2 else (0, 0)
    n_sel = int((labels != -100).sum()) if labels.shape == ids.shape else 0
    if not rep.result(not problems, "layout",
                      f"{len(shapes)} tensors, {sum(int(np.prod(s)) for s in shapes.values())} "
                      f"params, batch {B}x{T}, {n_sel} selected positions"
                      + ("" if not problems else ": " + "; ".join(problems[:8])
                         + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))):
        return

    ids_t, lab_t = torch.from_numpy(ids), torch.from_numpy(labels)
    ours_loss = float(loss_ours)

    # loss and gradients in fp32 (the criterion), and in fp64 as a yardstick:
    # the fp64 numbers show how much of any difference is fp32 rounding in
    # torch itself rather than a bug on our side.
    m32 = model_from(cfg, weights, torch.float32)
    l32 = m32(ids_t, lab_t)
    l32.backward()
    m64 = model_from(cfg, weights, torch.float64)
    l64 = m64(ids_t, lab_t)
    l64.backward()
    g32 = {n: p.grad for n, p in m32.named_parameters()}
    g64 = {n: p.grad for n, p in m64.named_parameters()}

    t = float(l32)
    rel = abs(ours_loss - t) / abs(t)
    rel64 = abs(ours_loss - float(l64)) / abs(float(l64))
    rep.result(rel <= 1e-5, "loss",
               f"ours {ours_loss:.8f} torch {t:.8f} rel {rel:.2e} (<= 1e-5); "
               f"vs torch fp64 {float(l64):.8f}: ours {rel64:.2e}, torch fp32 "
               f"{abs(t - float(l64)) / abs(float(l64)):.2e}")

    # One tensor needs a different yardstick: the key bias. Its exact
    # gradient is zero: adding b to every key adds q.b to every score in a
    # softmax row, which changes nothing, so sum_t dK[t] cancels exactly. What
    # fp32 gives (ours and torch's alike) is the rounding residue of that
    # cancelling sum, and max|g| over that tensor is noise, not a scale. The
    # residue scales with the dK terms being summed, whose scale is the key
    # weight's gradient dK^T x (x a LayerNorm output, O(1)); so for the key
    # bias we divide by max|g| of the key weight of the same layer. The
    # residue is ~u*sqrt(B*T) of that, far below 1e-4.
    rows = []
    for n in shapes:
        ours = torch.from_numpy(batch["grad." + n])
        ref = g32[n]
        den = float(ref.abs().max())
        if n.endswith("attention.self.key.bias"):
            den = max(den, float(g32[n[:-len("bias")] + "weight"].abs().max()))
        d = float((ours - ref).abs().max())
        r = d / den if den > 0 else (0.0 if d == 0 else math.inf)
        if not math.isfinite(float(ours.abs().max())):
            r = math.inf
        den64 = float(g64[n].abs().max())
        r_ours64 = float((ours.double() - g64[n]).abs().max()) / den64 if den64 else 0.0
        r_t64 = float((ref.double() - g64[n]).abs().max()) / den64 if den64 else 0.0
        rows.append((r, n, d, den, r_ours64, r_t64))
    rows.sort(key=lambda x: -x[0])
    worst = rows[0]
    rep.result(worst[0] <= 1e-4, "grads",
               f"{len(rows)} tensors, worst max|d|/max|g| {worst[0]:.2e} (<= 1e-4) in {worst[1]}")
    for r, n, d, den, r64, rt64 in rows[:5]:
        rep.line(f"    {n}: max|d| {d:.3e} max|g| {den:.3e} ratio {r:.2e}"
                 f"  [vs fp64: ours {r64:.1e}, torch fp32 {rt64:.1e}]")

    # One AdamW step in isolation: our gradient in, torch's optimizer, our
    # weights out. torch.optim.AdamW in fp32, two groups as our trainer has.
    m = model_from(cfg, weights, torch.float32)
    for n, p in m.named_parameters():
        p.grad = torch.from_numpy(batch["grad." + n].copy())
    clip_rel = 0.0
    if hp["clip"] > 0:
        norm64 = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in m.parameters()))
        norm_t = float(torch.nn.utils.clip_grad_norm_(m.parameters(), hp["clip"]))
        clip_rel = abs(norm_t - norm64) / norm64 if norm64 > 0 else 0.0
        rep.line(f"    clip {hp['clip']:g}: global norm torch {norm_t:.6g} (fp64 {norm64:.6g}), "
                 f"{'clipped' if norm64 > hp['clip'] else 'not clipped'}")
    opt = make_adamw(m, hp["lr"], (hp["beta1"], hp["beta2"]), hp["eps"], hp["weight_decay"])
    opt.step()

    # Tolerance, per element i (u = 2^-24, the fp32 unit roundoff):
    #     |p_ours - p_torch| <= 4u(|p0| + |p1|) + 32u*lr  [+ lr*(d_clip)/4]
    # Why. On step 1, m_hat = g and v_hat = g^2, so the update is
    # lr*g/(|g|+eps): at most lr in size. Each implementation rounds (a) the
    # decay factor 1 - lr*wd and the product p0*(1 - lr*wd): <= 2u|p0|; (b)
    # the final p - update: <= u|p1|; (c) the update itself, built from ~10
    # correctly rounded fp32 operations ((1-b1)*g, g*g*(1-b2), sqrt, two
    # bias corrections, +eps, the division, *step_size): <= 10u*lr relative
    # to the exact value. Whether a kernel fuses a multiply-add only changes
    # which of these roundings happen, not the bound. Two implementations
    # each within 2u|p0| + u|p1| + 10u*lr of the exact result differ by at
    # most 4u|p0| + 2u|p1| + 20u*lr, which we round up to the bound above:
    # a few ulps of p plus a few ulps of lr, nowhere near what a wrong
    # formula (eps inside the square root, a missing bias correction, decay
    # on a LayerNorm gain, coupled L2 decay) produces, which is of order lr.
    # With clipping, the two sides scale g by coefficients computed from
    # differently rounded global norms, relative gap d_clip. The update
    # g/(|g|+eps) has relative sensitivity eps*|g|/(|g|+eps)^2 <= 1/4 to the
    # scale of g, so that adds at most lr*d_clip/4. We measure torch's norm
    # against fp64 and allow ours ASSUMED_CLIP_NORM_REL (1e-5) on top.
    lr = hp["lr"]
    clip_term = lr * (clip_rel + ASSUMED_CLIP_NORM_REL) / 4 if hp["clip"] > 0 else 0.0
    total = equal = 0
    max_d, max_d_name, max_ratio, max_ratio_name, max_ulps, max_ulps_name = \
        0.0, "-", 0.0, "-", 0.0, "-"
    for n, p in m.named_parameters():
        p0 = weights[n].astype(np.float64)
        pt = p.detach().numpy()
        po = after[n]
        total += pt.size
        equal += int((pt.view(np.uint32) == po.view(np.uint32)).sum())
        diff = np.abs(po.astype(np.float64) - pt.astype(np.float64))
        tol = 4 * U * (np.abs(p0) + np.abs(pt.astype(np.float64))) + 32 * U * lr + clip_term
        if not np.isfinite(po).all():
            diff = np.where(np.isfinite(po), diff, np.inf)
        d = float(diff.max())
        ratio = float((diff / tol).max())
        # in units of ulp(max|p|) of this tensor, the scale the bound is in
        ulps = d / float(np.spacing(np.abs(pt).max()))
        if ulps > max_ulps:
            max_ulps, max_ulps_name = ulps, n
        if d > max_d:
            max_d, max_d_name = d, n
        if ratio > max_ratio:
            max_ratio, max_ratio_name = ratio, n
    rep.result(max_ratio <= 1.0, "adamw",
               f"{equal}/{total} bitwise equal, max|dp| {max_d:.3e} in {max_d_name}, "
               f"worst {max_ulps:.2f} ulp(max|p|) in {max_ulps_name}, worst |dp|/tol "
               f"{max_ratio:.3f} in {max_ratio_name} (<= 1; tol = 4u(|p0|+|p1|) + 32u*lr"
               f"{' + lr*dclip/4' if clip_term else ''}, lr {lr:g})")


# ----------------------------------------------------------------------------
# mixed: a bf16 / fp16 dump
#
# Our mixed precision stores every activation, activation gradient and
# parameter gradient in 16 bits and computes each operation in fp32, rounding
# its result once (notes/08). torch.autocast keeps LayerNorm outputs and
# residual sums in fp32 instead, so the two round in different places and can
# only agree within rounding. The yardstick is the exact result: fp64 on the
# same 16-bit weights. Tolerances, with u the format's unit roundoff (2^-8
# bf16, 2^-11 fp16):
#   loss   relative error <= u. The loss is a mean of fp32 cross-entropies of
#          16-bit logits, which the forward's roundings (about 20 on the
#          longest path) perturb by a few u of their size; the loss moves
#          by its derivative times that, and at step 0 (the dump's step,
#          0.02-scale weights) the logits are small and the loss sits near
#          ln 260, so this bound is loose: it checks that the loss is computed
#          from the right logits, not how precise it is.
#   grads  per tensor, ||g - g_ref|| / ||g_ref|| <= 8u. The longest path a
#          gradient takes through a 2-block model passes about 20 roundings
#          to 16 bits (forward and backward), each at most u relative;
#          independent errors add like a random walk, sqrt(20) u ~ 4.5 u for
#          each side, and two sides differ by up to sqrt(2) of that ~ 6.3 u,
#          rounded up to 8u. A wrong formula (a missing scale, a transposed
#          product, an unscaled fp16 gradient) is off by O(1), not O(u).
#          The key biases' exact gradient is 0 (a key bias shifts a softmax
#          row uniformly), so their residue is measured against the key
#          weight's gradient, as `check` does.
# torch 1.13's CPU autocast knows only bfloat16, and does not cast a 16-bit
# input of layer_norm to fp32 as CUDA autocast does (it fails on the mixed
# dtypes): we give layer_norm fp32 inputs, as CUDA autocast would.

def mixed(dump_dir, rep):
    cfg = Config.load(dump_dir)
    precision = cfg.raw.get("zero2_precision")
    if precision not in ("bf16", "fp16"):
        raise BadInput(f"{dump_dir}/config.json has no \"zero2_precision\": \"bf16\" or \"fp16\": "
                       "not a mixed-precision dump (run the trainer with --precision bf16 or fp16)")
    weights, _ = read_safetensors(os.path.join(dump_dir, "model.safetensors"))
    batch, meta = read_safetensors(os.path.join(dump_dir, "batch.safetensors"))
    if float(meta.get("dropout", "nan")) != 0.0:
        raise BadInput("the dump was made with dropout; re-run with --dropout 0")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    u = 2.0 ** (-8 if precision == "bf16" else -11)
    # The dump holds the 16-bit working weights: each is exact in the format.
    inexact = [n for n, a in weights.items()
               if not np.array_equal(torch.from_numpy(a).to(dtype).float().numpy(), a)]
    rep.result(not inexact, "mixed weights",
               f"{len(weights)} tensors, every value a {precision} number"
               + ("" if not inexact else f": not in {', '.join(inexact[:3])}"))
    ids, labels = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["labels"])
    ours_loss = float(batch["loss"])

    def run(param_dtype, autocast=None):
        m = model_from(cfg, weights, param_dtype)
        if autocast is None:
            loss = m(ids, labels)
        else:
            layer_norm = F.layer_norm
            F.layer_norm = lambda x, *a, **k: layer_norm(x.float(), *a, **k)
            try:
                with torch.autocast("cpu", dtype=autocast):
                    loss = m(ids, labels)
            finally:
                F.layer_norm = layer_norm
        loss.backward()
        return float(loss), {n: p.grad.double() for n, p in m.named_parameters()}

    l64, g64 = run(torch.float64)
    references = [("fp64", l64, g64)]
    if precision == "bf16":
        lac, gac = run(torch.float32, torch.bfloat16)
        references.append(("torch.autocast bf16", lac, gac))
    ours = {n: torch.from_numpy(batch["grad." + n]).double() for n in g64}

    def scale(n, grads):  # what a difference in tensor n is measured against
        den = float(grads[n].norm())
        if n.endswith("attention.self.key.bias"):
            den = max(den, float(grads[n[:-len("bias")] + "weight"].norm()))
        return den

    def relative(a, ref, n, grads):
        den, d = scale(n, grads), float((a - ref).norm())
        return d / den if den > 0 else (0.0 if d == 0 else math.inf)

    for name, loss, grads in references:
        rel = abs(ours_loss - loss) / abs(loss)
        rep.result(rel <= u, f"mixed loss vs {name}",
                   f"ours {ours_loss:.7f} {name} {loss:.7f} rel {rel:.2e} (<= u = {u:.2e})")
        # Against fp64 the bound is 8u. Against another 16-bit computation
        # (autocast) its own error adds: ||ours - ref|| <= ||ours - fp64|| +
        # ||fp64 - ref||, the first at most 8u of fp64's scale (checked
        # against fp64 above), the second measured; relative to ref's scale.
        # (torch 1.13's CPU autocast sits from 6u to 10u off fp64 depending
        # on the CPU's kernels: 3.9e-2 measured on one without AVX-512.)
        def bound(n):
            if name == "fp64":
                return 8 * u
            own = float((grads[n] - g64[n]).norm())
            return (8 * u * scale(n, g64) + own) / max(scale(n, grads), 1e-300)
        rows = sorted(((relative(ours[n], grads[n], n, grads), n, bound(n)) for n in g64), reverse=True)
        median = rows[len(rows) // 2][0]
        over = [r for r in rows if r[0] > r[2]]
        line = (f"{len(rows)} tensors, worst ||d||/||g|| {rows[0][0]:.2e} in {rows[0][1]} (<= "
                + (f"8u = {8 * u:.2e}" if name == "fp64" else f"8u + its own error vs fp64 = {rows[0][2]:.2e}")
                + f"), median {median:.2e}")
        if name != "fp64":
            errors = sorted(relative(grads[n], g64[n], n, g64) for n in g64)
            line += f"; {name} itself vs fp64: median {errors[len(errors) // 2]:.2e}, worst {errors[-1]:.2e}"
        if over:
            line += f"; over the bound: {over[0][1]} {over[0][0]:.2e} > {over[0][2]:.2e}"
        rep.result(not over, f"mixed grads vs {name}", line)
    if precision == "bf16":
        # For comparison only: torch with the whole model in bf16.
        lbf, gbf = run(torch.bfloat16)
        errors = sorted(relative(gbf[n], g64[n], n, g64) for n in g64)
        rep.line(f"note: torch with the model in bf16 (module.bfloat16()), vs fp64: loss rel "
                 f"{abs(lbf - l64) / abs(l64):.2e}, grads median {errors[len(errors) // 2]:.2e}, worst {errors[-1]:.2e}")


# ----------------------------------------------------------------------------
# selftest

def _fake_dump(root, cfg, seed, hp):
    """Writes DUMP_DIR and AFTER_DIR as our trainer would, but from torch:
    loss and gradients from an fp64 copy of the model (so the fp32 check has
    genuine rounding differences to tolerate), and the after-weights from an
    fp64 AdamW written out here, rounded once to fp32 (so the optimizer check
    compares two different implementations, as it does for real)."""
    gen = torch.Generator().manual_seed(seed)
    m = BertMLM(cfg)
    m.init_random(gen, std=0.1)
    weights = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    B, T = 4, 16
    ids = torch.randint(0, 256, (B, T), generator=gen)
    sel = torch.rand((B, T), generator=gen) < 0.15
    sel[0, 0] = True
    labels = torch.where(sel, ids, torch.full_like(ids, -100))
    ids = torch.where(sel & (torch.rand((B, T), generator=gen) < 0.8),
                      torch.full_like(ids, 259), ids)
    m64 = model_from(cfg, weights, torch.float64)
    loss = m64(ids, labels)
    loss.backward()
    grads = {n: p.grad.float().numpy() for n, p in m64.named_parameters()}

    # fp64 AdamW, step 1, straight from the paper's formulas (not torch's).
    g64 = {n: g.astype(np.float64) for n, g in grads.items()}
    coef = 1.0
    if hp["clip"] > 0:
        norm = math.sqrt(sum(float((g ** 2).sum()) for g in g64.values()))
        coef = min(1.0, hp["clip"] / (norm + 1e-6))
    b1, b2, lr, eps = hp["beta1"], hp["beta2"], hp["lr"], hp["eps"]
    after = {}
    for n, w in weights.items():
        g = g64[n] * coef
        mh = (1 - b1) * g / (1 - b1)
        vh = (1 - b2) * g * g / (1 - b2)
        wd = hp["weight_decay"] if decays(n) else 0.0
        after[n] = (w.astype(np.float64) * (1 - lr * wd)
                    - lr * mh / (np.sqrt(vh) + eps)).astype(np.float32)

    dump, aft = os.path.join(root, "dump"), os.path.join(root, "after")
    for d, ws in ((dump, weights), (aft, after)):
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        write_safetensors(os.path.join(d, "model.safetensors"), ws, {"format": "pt"})
    bt = {"input_ids": ids.numpy(), "labels": labels.numpy(),
          "loss": np.array(float(loss), dtype=np.float32)}
    bt.update({"grad." + n: g for n, g in grads.items()})
    write_safetensors(os.path.join(dump, "batch.safetensors"), bt,
                      {k: repr(v) for k, v in hp.items()})
    return dump, aft


def selftest():
    torch.manual_seed(0)
    cfg = Config({"vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "intermediate_size": 64,
                  "max_position_embeddings": 24, "type_vocab_size": 1,
                  "layer_norm_eps": 1e-12, "hidden_dropout_prob": 0.0,
                  "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu"})
    # clip 0.5 is below the gradient norm of this model, so clipping engages.
    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
          "weight_decay": 0.01, "clip": 0.5, "dropout": 0.0}
    total = Report()
    with tempfile.TemporaryDirectory(prefix="torch_reference_") as root:
        dump, aft = _fake_dump(root, cfg, 1234, hp)

        # safetensors round trip: bytes we wrote read back identically,
        # header is 8-aligned, scalars and int64 survive.
        b, meta = read_safetensors(os.path.join(dump, "batch.safetensors"))
        with open(os.path.join(dump, "batch.safetensors"), "rb") as f:
            (hn,) = struct.unpack("<Q", f.read(8))
        ok = (hn % 8 == 0 and b["loss"].shape == () and b["input_ids"].dtype == np.int64
              and float(meta["lr"]) == hp["lr"] and (b["labels"] == -100).any())
        total.result(ok, "safetensors-roundtrip",
                     f"header {hn} bytes, {len(b)} tensors, metadata {sorted(meta)}")

        total.line("== check on a faithful dump (torch fp64 grads, fp64 AdamW) ==")
        check(dump, aft, total)

        def expect_fail(name, mutate, want):
            """Corrupts a copy of the dump, runs check on it, and passes if
            the named check (and only checks in `want`) failed."""
            d2 = os.path.join(root, name)
            a2 = os.path.join(root, name + "_after")
            os.makedirs(d2)
            os.makedirs(a2)
            for src, dst in ((dump, d2), (aft, a2)):
                for fn in os.listdir(src):
                    with open(os.path.join(src, fn), "rb") as f, \
                            open(os.path.join(dst, fn), "wb") as g:
                        g.write(f.read())
            mutate(d2, a2)
            total.line(f"== check on a corrupted dump ({name}); must FAIL {want} ==")
            inner = Report(prefix="  | ")
            try:
                check(d2, a2, inner)
                got = "failed: " + (", ".join(inner.failed_names) or "none")
                ok = inner.failed_names == [want]
            except BadInput as e:
                inner.line(f"refused: {e}")
                got, ok = "refused", want == "refusal"
            total.result(ok, f"detects-{name}", f"({got})")

        def perturb_grad(d, a):
            p = os.path.join(d, "batch.safetensors")
            t, md = read_safetensors(p)
            g = t["grad.bert.encoder.layer.1.attention.self.key.weight"]
            # 10x the tolerance: 1e-3 of the tensor's largest gradient.
            g.flat[7] += 1e-3 * np.abs(g).max()
            write_safetensors(p, t, md)

        def perturb_after(d, a):
            p = os.path.join(a, "model.safetensors")
            t, md = read_safetensors(p)
            w = t["bert.encoder.layer.0.output.LayerNorm.bias"]
            # as if weight decay were applied to a bias: lr*wd*p, a few ulps
            w[:] = (w.astype(np.float64) * (1 - hp["lr"] * hp["weight_decay"])).astype(np.float32)
            write_safetensors(p, t, md)

        def perturb_loss(d, a):
            p = os.path.join(d, "batch.safetensors")
            t, md = read_safetensors(p)
            t["loss"] = np.array(float(t["loss"]) * (1 + 5e-5), dtype=np.float32)
            write_safetensors(p, t, md)

        def with_dropout(d, a):
            p = os.path.join(d, "batch.safetensors")
            t, md = read_safetensors(p)
            md["dropout"] = "0.1"
            write_safetensors(p, t, md)

        expect_fail("perturbed-grad", perturb_grad, "grads")
        expect_fail("perturbed-after", perturb_after, "adamw")
        expect_fail("perturbed-loss", perturb_loss, "loss")
        expect_fail("dropout-dump", with_dropout, "refusal")
    return total


# ----------------------------------------------------------------------------
# bench

def bench(a):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = Config({"vocab_size": 260, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
                  "num_attention_heads": a.heads, "intermediate_size": a.intermediate,
                  "max_position_embeddings": max(512, a.seq), "type_vocab_size": 1,
                  "layer_norm_eps": 1e-12, "hidden_act": "gelu"})
    m = BertMLM(cfg, dropout=a.dropout)
    m.init_random(torch.Generator().manual_seed(a.seed), std=0.02)
    m.train()
    B, T = a.batch, a.seq
    ids = torch.randint(0, 256, (B, T))
    sel = torch.rand(B, T) < 0.15
    sel[0, 0] = True
    labels = torch.where(sel, ids, torch.full_like(ids, -100))
    ids = torch.where(sel, torch.full_like(ids, 259), ids)
    opt = make_adamw(m, 1e-4, (0.9, 0.999), 1e-8, 0.01)

    def step():
        loss = m(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    for _ in range(a.warmup_steps):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    dt = time.perf_counter() - t0
    print(f"torch {torch.__version__} fp32 CPU, {a.threads} threads: L={a.layers} "
          f"H={a.hidden} NH={a.heads} F={a.intermediate} T={T} B={B} dropout {a.dropout:g}, "
          f"{a.steps} steps in {dt:.3f} s ({1000 * dt / a.steps:.1f} ms/step), loss {loss:.4f}")
    print(f"torch tokens/s: {B * T * a.steps / dt:.1f}")


# ----------------------------------------------------------------------------

def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="PyTorch reference for train_bert_mini")
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("check", help="compare a --dump-batch dump and a 1-step export")
    c.add_argument("dump_dir")
    c.add_argument("after_dir")
    x = sub.add_parser("mixed", help="check a bf16 / fp16 dump against fp64 and torch.autocast")
    x.add_argument("dump_dir")
    b = sub.add_parser("bench", help="time torch training steps")
    for k, d in (("layers", 4), ("hidden", 256), ("heads", 4), ("intermediate", 1024),
                 ("seq", 128), ("batch", 16), ("steps", 10), ("threads", 1), ("seed", 0)):
        b.add_argument("--" + k, type=int, default=d)
    b.add_argument("--warmup-steps", type=int, default=2)
    b.add_argument("--dropout", type=float, default=0.0)
    sub.add_parser("selftest", help="check a fake dump made by torch, and corrupted ones")
    a = ap.parse_args(argv)

    try:
        if a.mode == "bench":
            bad = [k for k in ("layers", "hidden", "heads", "intermediate", "seq",
                               "batch", "steps", "threads") if getattr(a, k) < 1]
            if bad or a.warmup_steps < 0 or a.hidden % a.heads or not 0 <= a.dropout < 1:
                raise BadInput("bench: sizes, steps and threads must be >= 1, warmup "
                               ">= 0, hidden divisible by heads, 0 <= dropout < 1")
            bench(a)
            return 0
        rep = Report()
        if a.mode == "check":
            check(a.dump_dir, a.after_dir, rep)
        elif a.mode == "mixed":
            mixed(a.dump_dir, rep)
        else:
            rep = selftest()
    except BadInput as e:
        print(f"torch_reference: {e}", file=sys.stderr)
        return 2
    print(f"{rep.passed} passed, {rep.failed} failed")
    return 0 if rep.failed == 0 and rep.passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
