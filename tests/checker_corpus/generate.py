"""tests/checker_corpus/generate.py: the planted-bug corpus for tests/check_trace.py, generated from the bug
taxonomy (tests/bug_taxonomy.py), and its split into a development half and a held-out half.

Every case is one replay of a zero2 trace by the torch peer (tests/peers/torch_peer.py), either correct or with
one mistake of one taxonomy class planted in a copy of the peer (exact text edits of torch_peer.py, each of
which must match its source exactly once, or the case is reported as a broken plant rather than run). A case:

    id          "<class id or correct.<variant>>@<configuration>/<step>", e.g.
                "reduction.summed@n4-a1-fp32-small-s8/flat", "correct.reversed-sum@n2-a4-bf16-small-s8/flat"
    kind        "bug" or "correct"
    cls         the taxonomy class id (bugs), or null
    variant     the correct variant's name (correct cases), or the plant's name (bugs: the class id, with its
                size where a class is planted at more than one size)
    config      the reference trace's configuration (CONFIGS below): N, A, precision, model, steps
    step        the peer's --step: flat (zero2's layout, sharded_step) or zero-redundancy (DDP + ZeRO-1)
    edits       [[old, new], ...] applied to a copy of torch_peer.py ([] : the peer as it is)
    size        {"lr": rel, "weight_decay": rel, "grad_scale": rel, "clip": rel, ...}: the plant's relative
                error where it has one size (|theirs / zero2's - 1| of that quantity), else {}; a PASS by the
                checker is legitimate only where that size is below the power it states for the kind
    quick       part of run.sh --quick

Usage (stdlib only):
    python3 tests/checker_corpus/generate.py list [dev|held-out|all]    the cases as JSON lines
    python3 tests/checker_corpus/generate.py split                      rewrite split.json from the rule
    python3 tests/checker_corpus/generate.py plant CASE_ID OUT.py       write the case's peer copy (exit 3: the
                                                                        edit no longer matches torch_peer.py)
    python3 tests/checker_corpus/generate.py check                      every plant applies and compiles
    python3 tests/checker_corpus/generate.py counts                     the cases per half, by class and variant
    python3 tests/checker_corpus/generate.py tsv [dev|held-out|all]     run.sh's list (id, config, step, ...)

The split: a case is in the held-out half when the first byte of sha256(id) is odd, in the development half
when it is even (split.json records it; run.sh refuses a case whose recorded half disagrees with the rule).
"""
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from bug_taxonomy import BY_ID, CATEGORIES, CLASSES  # noqa: E402

CATEGORIES_ORDER = CATEGORIES

PEER = os.path.join(ROOT, "tests", "peers", "torch_peer.py")

# ----------------------------------------------------------------------------
# The reference traces: tests/peers/reference_trace.sh's small model (or BERT-mini's default size), with
# every step kept (the checker's AdamW replay rebuilds the state from step 1 and needs the parameters before
# the failing step).


def config(n, a, precision, model="small", steps=8):
    return f"n{n}-a{a}-{precision}-{model}-s{steps}"


def parse_config(name):
    n, a, precision, model, steps = name.split("-")
    return {"world_size": int(n[1:]), "accumulation_steps": int(a[1:]), "precision": precision, "model": model,
            "steps": int(steps[1:])}


def reference_flags(name):
    """The flags after `reference_trace.sh TRAINER DIR N` for this configuration."""
    c = parse_config(name)
    flags = ["--steps", str(c["steps"]), "--accum", str(c["accumulation_steps"]), "--precision", c["precision"],
             "--trace-params-every", "1" if c["steps"] <= 8 else "20"]
    if c["model"] == "large":  # BERT-mini's default sizes (3.4M parameters), its default batch
        flags += ["--layers", "4", "--hidden", "256", "--heads", "4", "--intermediate", "1024", "--seq", "128",
                  "--micro-batch", "8", "--bucket", "524288"]
    return flags


# ----------------------------------------------------------------------------
# The texts of torch_peer.py that plants edit (each must occur exactly once)

BETAS = '    beta1, beta2 = settings["betas"]\n'
BUCKET = '        bucket = layout.grads[b["offset"]:b["offset"] + b["padded_length"]]\n'
RECEIVE = ('        received = torch.empty_like(bucket)                 # [N, shard]: row j is rank j\'s slice r\n'
           '        dist.all_to_all_single(received, bucket)\n'
           '        rows = received.view(N, b["shard_length"])\n')
SUM = '        summed = rows[0].clone()\n        for j in range(1, N):\n            summed += rows[j]\n'
REDUCED = '        own.append(summed / N)\n'
SQUARES = '    squares = (grad * grad).sum()\n'
ALL_REDUCE_SQUARES = '    dist.all_reduce(squares)\n'
CLIP = '    clip = settings["clip"]\n'
CLIPPED = "    clipped = grad * min(1.0, clip / (norm + 1e-6)) if clip > 0 else grad  # clip_grad_norm_'s coefficient\n"
OWN_PARAMS = '    params = layout.own(layout.params)\n'
M = '    layout.exp_avg.mul_(beta1).add_(clipped, alpha=1 - beta1)\n'
V = '    layout.exp_avg_sq.mul_(beta2).addcmul_(clipped, clipped, value=1 - beta2)\n'
DECAY = '    params.mul_(1 - lr * settings["weight_decay"] * layout.decay)\n'
DENOMINATOR = '    denominator = (layout.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(settings["eps"])\n'
UPDATE = '    params.addcdiv_(layout.exp_avg, denominator, value=-lr / (1 - beta1 ** step))\n'
GATHER = ('        dist.all_gather(shards, params[start:start + b["shard_length"]].contiguous())\n'
          '        layout.params[b["offset"]:b["offset"] + b["padded_length"]] = torch.cat(shards)\n')
ENTRIES = '            self.entries.append((tensor, p["offset"], p["numel"], p["decay"]))\n'
GRAD_NONE = '            tensor.grad = None\n'
ZR_ZERO_GRAD = '        self.optimizer.zero_grad(set_to_none=True)\n'
LOSS_RETURN = ('    return summed * world_size / max(1, selected_in_global_batch)  # none selected: a zero loss, as '
               'zero2\'s\n')
BATCH = '    input_ids, labels = (torch.from_numpy(np.array(a)) for a in reference.batch(step))\n'
MICRO_BATCH = "        m = a * N + rank                     # the micro-batch zero2's rank r computes at micro-step a\n"
PART = '            part = loss_of(logits, labels[rows], selected, N)\n'
BACKWARD = '            part.backward()\n'
STEP_LOSS = "    return loss / N                          # what DDP's averaged loss is: the ranks' mean\n"
STEP_CALL = '        norm = stepper.step(lr, step)\n'
TRAIN = '    model.train()  # dropout 0: train mode computes what eval mode would\n'
DROPOUT = '                                            attention_probs_dropout_prob=0.0)\n'

BOTH = ("flat", "zero-redundancy")
FLAT = ("flat",)


def plant(cls, edits, steps=FLAT, needs=(), size=None, name=None, cls_at=None):
    """A class's plant. needs: "A>1" (no mistake at A = 1), "bf16" (a mixed-precision mistake). size: a function
    of the configuration's parse (a dict) giving the plant's relative errors, or None. cls_at: a function of the
    configuration's parse giving the class the plant is there, where that depends on it (the case's id keeps
    the plant's name)."""
    assert cls in BY_ID, cls
    return {"cls": cls, "edits": edits, "steps": steps, "needs": needs, "size": size, "name": name or cls,
            "cls_at": cls_at}


def scaled(factor):
    return abs(factor - 1)


PLANTS = [
    # --- data
    plant("data.batch-of-next-step",
          [[BATCH, BATCH.replace("reference.batch(step)", "reference.batch(min(step + 1, len(reference.steps)))")]],
          BOTH),
    plant("data.rank-rows-duplicated", [[MICRO_BATCH, "        m = a * N                            # the mistake\n"]],
          BOTH),
    plant("data.labels-all-positions",
          [[PART, "            part = loss_of(logits, torch.where(labels[rows] == -100, input_ids[rows], labels[rows]),"
                  " labels.numel(), N)\n"]], BOTH),
    # --- the loss
    # Hugging Face's mean per micro-batch, over A micro-steps and then DDP's ranks: at A = 1 the mean of the
    # ranks' means; at A > 1 the mean of the micro-batches' means, a class of its own (the label was the first
    # one at every A until the dev half showed the checker naming the second, which is what this plants).
    plant("loss.mean-of-rank-means",
          [[LOSS_RETURN, "    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), "
                         "ignore_index=-100)\n"],
           [PART, PART.replace("N)\n", "N) / A\n")]], BOTH,
          cls_at=lambda c: "loss.mean-of-micro-batch-means" if c["accumulation_steps"] > 1 else "loss.mean-of-rank-means"),
    plant("loss.divided-by-A", [[PART, PART.replace("N)\n", "N) / A\n")]], BOTH, needs=("A>1",),
          size=lambda c: {"grad_scale": scaled(1 / c["accumulation_steps"])}),
    plant("loss.summed-over-ranks", [[STEP_LOSS, "    return loss\n"]], BOTH),
    plant("loss.summed-cross-entropy", [[LOSS_RETURN, "    return summed * world_size\n"]], BOTH),
    # --- accumulation
    plant("accumulation.overwrites",
          [[BACKWARD, "            for p in stepper.model.parameters():\n                p.grad = None\n" + BACKWARD]],
          BOTH, needs=("A>1",)),
    plant("accumulation.not-zeroed", [[GRAD_NONE, ""], [ZR_ZERO_GRAD, ""]], BOTH),
    plant("accumulation.summed-not-averaged", [[BACKWARD, "            (part * A).backward()\n"]], BOTH,
          needs=("A>1",), size=lambda c: {"grad_scale": scaled(c["accumulation_steps"])}),
    # --- the reduction
    plant("reduction.summed", [[REDUCED, "        own.append(summed)\n"]],
          size=lambda c: {"grad_scale": scaled(c["world_size"])}),
    plant("reduction.averaged-twice", [[REDUCED, "        own.append(summed / N / N)\n"]],
          size=lambda c: {"grad_scale": scaled(1 / c["world_size"])}),
    plant("reduction.bucket-skipped",
          [[REDUCED, "        own.append(summed / N if b is not layout.buckets[-1] else torch.zeros_like(summed))\n"]]),
    plant("reduction.bucket-local",
          [[REDUCED, "        own.append(summed / N if b is not layout.buckets[-1] else bucket.view(N, -1)[r] / N)\n"]]),
    plant("reduction.stale",
          [[REDUCED, "        if b is layout.buckets[-1]:  # the mistake: the last bucket's gradient of the step before\n"
                     "            fresh = summed / N\n"
                     "            own.append(getattr(layout, 'stale_last_bucket', fresh))\n"
                     "            layout.stale_last_bucket = fresh\n"
                     "        else:\n"
                     "            own.append(summed / N)\n"]]),
    plant("reduction.rank-shard-zero",
          [[REDUCED, "        own.append(summed / N if r != N - 1 else torch.zeros_like(summed))\n"]]),
    # --- clipping
    plant("clipping.none", [[CLIPPED, "    clipped = grad\n"]]),
    plant("clipping.local-norm",
          [[CLIPPED, "    clipped = grad * min(1.0, clip / (grad.norm().item() + 1e-6)) if clip > 0 else grad\n"]]),
    plant("clipping.per-group",
          [[CLIPPED, "    clipped = grad.clone()\n"
                     "    for group in (layout.decay > 0, layout.decay == 0):  # the mistake: each group its own norm\n"
                     "        group_squares = (grad[group] * grad[group]).sum()\n"
                     "        dist.all_reduce(group_squares)\n"
                     "        if clip > 0:\n"
                     "            clipped[group] = grad[group] * min(1.0, clip / (group_squares.sqrt().item() + 1e-6))\n"]]),
    plant("clipping.per-tensor",
          [[CLIPPED, "    ids = torch.full((layout.params.numel(),), float(len(layout.entries)))  # padding: its own id\n"
                     "    for i, (_, offset, numel, _) in enumerate(layout.entries):\n"
                     "        ids[offset:offset + numel] = float(i)\n"
                     "    own_ids = layout.own(ids).long()\n"
                     "    tensor_squares = torch.zeros(len(layout.entries) + 1).index_add_(0, own_ids, grad * grad)\n"
                     "    dist.all_reduce(tensor_squares)  # the mistake: each tensor clipped by its own norm\n"
                     "    coefficients = torch.clamp(clip / (tensor_squares.sqrt() + 1e-6), max=1.0)\n"
                     "    clipped = grad * coefficients[own_ids] if clip > 0 else grad\n"]]),
    plant("clipping.threshold-scaled", [[CLIP, '    clip = settings["clip"] * 2\n']],
          size=lambda c: {"clip": 1.0}, name="clipping.threshold-scaled.x2"),
    plant("clipping.threshold-scaled", [[CLIP, '    clip = settings["clip"] * 1.05\n']],
          size=lambda c: {"clip": 0.05}, name="clipping.threshold-scaled.x1.05"),
    plant("clipping.norm-before-average", [[SQUARES, "    squares = ((grad * N) * (grad * N)).sum()\n"]],
          size=lambda c: {"clip": scaled(1 / c["world_size"])}),
    plant("clipping.norm-own-shard", [[ALL_REDUCE_SQUARES, ""]]),
    # --- AdamW
    plant("adamw.l2-decay",
          [[M, '    clipped = clipped + settings["weight_decay"] * layout.decay * params\n' + M], [DECAY, ""]]),
    plant("adamw.no-decay", [[DECAY, ""]], size=lambda c: {"weight_decay": 1.0}),
    plant("adamw.decay-everything", [[DECAY, '    params.mul_(1 - lr * settings["weight_decay"])\n']]),
    plant("adamw.no-decay-on-embeddings",
          [[ENTRIES, ENTRIES.replace('p["decay"]))', 'p["decay"] and "embeddings" not in p["name"]))')]]),
    plant("adamw.decay-without-lr", [[DECAY, '    params.mul_(1 - settings["weight_decay"] * layout.decay)\n']],
          size=lambda c: {"weight_decay": 999.0}),  # 1 / lr - 1 at the peak rate 1e-3, more below it
    plant("adamw.decay-scaled", [[DECAY, DECAY.replace('settings["weight_decay"]', 'settings["weight_decay"] * 2')]],
          size=lambda c: {"weight_decay": 1.0}, name="adamw.decay-scaled.x2"),
    plant("adamw.decay-scaled", [[DECAY, DECAY.replace('settings["weight_decay"]', 'settings["weight_decay"] * 1.1')]],
          size=lambda c: {"weight_decay": 0.1}, name="adamw.decay-scaled.x1.1"),
    plant("adamw.eps-inside",
          [[DENOMINATOR, '    denominator = (layout.exp_avg_sq / (1 - beta2 ** step) + settings["eps"]).sqrt()\n']]),
    plant("adamw.eps-inside-uncorrected",
          [[DENOMINATOR, '    denominator = (layout.exp_avg_sq + settings["eps"]).sqrt() / math.sqrt(1 - beta2 ** step)\n']]),
    plant("adamw.eps-other", [[DENOMINATOR, DENOMINATOR.replace('add_(settings["eps"])', 'add_(1e-6)')]],
          size=lambda c: {"eps": 99.0}),
    plant("adamw.no-bias-correction",
          [[DENOMINATOR, '    denominator = layout.exp_avg_sq.sqrt().add_(settings["eps"])\n'],
           [UPDATE, '    params.addcdiv_(layout.exp_avg, denominator, value=-lr)\n']]),
    plant("adamw.no-bias-correction-m", [[UPDATE, '    params.addcdiv_(layout.exp_avg, denominator, value=-lr)\n']]),
    plant("adamw.no-bias-correction-v",
          [[DENOMINATOR, '    denominator = layout.exp_avg_sq.sqrt().add_(settings["eps"])\n']]),
    plant("adamw.betas-swapped", [[BETAS, '    beta2, beta1 = settings["betas"]\n']]),
    plant("adamw.momentum-undamped", [[M, '    layout.exp_avg.mul_(beta1).add_(clipped)\n']]),
    plant("adamw.v-of-abs", [[V, '    layout.exp_avg_sq.mul_(beta2).add_(clipped.abs(), alpha=1 - beta2)\n']]),
    # --- the optimizer's state
    plant("state.reset-each-step", [[BETAS, BETAS + "    layout.exp_avg.zero_()\n    layout.exp_avg_sq.zero_()\n"]]),
    plant("state.counter-ahead", [[BETAS, BETAS + "    step = step + 1\n"]]),
    plant("state.counter-micro-steps", [[STEP_CALL, "        norm = stepper.step(lr, step * A)\n"]], needs=("A>1",)),
    # --- the schedule
    plant("schedule.lr-of-step-before",
          [[STEP_CALL, '        norm = stepper.step(reference.steps[max(step - 2, 0)]["lr"], step)\n']], BOTH),
    plant("schedule.lr-of-step-after",
          [[STEP_CALL, '        norm = stepper.step(reference.steps[min(step, len(reference.steps) - 1)]["lr"], step)\n']],
          BOTH),
    plant("schedule.lr-scaled", [[STEP_CALL, "        norm = stepper.step(lr * N, step)\n"]], BOTH,
          size=lambda c: {"lr": scaled(c["world_size"])}, name="schedule.lr-scaled.xN"),
    plant("schedule.lr-scaled", [[STEP_CALL, "        norm = stepper.step(lr * 1.05, step)\n"]], BOTH,
          size=lambda c: {"lr": 0.05}, name="schedule.lr-scaled.x1.05"),
    plant("schedule.warmup-from-zero",
          [[STEP_CALL, '        norm = stepper.step(reference.steps[step - 2]["lr"] if step > 1 else 0.0, step)\n']],
          BOTH),
    # --- sharding and the all-gather
    plant("sharding.stale-all-gather",
          [[OWN_PARAMS, OWN_PARAMS + "    stale = params.clone()  # the mistake: the all-gather sends these\n"],
           [GATHER, '        dist.all_gather(shards, stale[start:start + b["shard_length"]].contiguous())\n'
                    '        shards[r] = params[start:start + b["shard_length"]]  # its own shard, updated, kept locally\n'
                    '        layout.params[b["offset"]:b["offset"] + b["padded_length"]] = torch.cat(shards)\n']]),
    plant("sharding.offset-off-by-one",
          [[OWN_PARAMS, '    params = torch.cat([layout.params[b["offset"] + (r + 1) % N * b["shard_length"]:  # r + 1\n'
                        '                                      b["offset"] + ((r + 1) % N + 1) * b["shard_length"]]\n'
                        '                        for b in layout.buckets])\n']]),
    plant("sharding.rank-skips-all-gather",
          [[GATHER, '        dist.all_gather(shards, params[start:start + b["shard_length"]].contiguous())\n'
                    '        if step == 3 and r == 0:  # the mistake: rank 0 keeps only its own shards at step 3\n'
                    '            layout.params[b["offset"]:b["offset"] + b["shard_length"]] = shards[0]\n'
                    '        else:\n'
                    '            layout.params[b["offset"]:b["offset"] + b["padded_length"]] = torch.cat(shards)\n']]),
    # --- the tied weights
    plant("tied.decoder-untied",
          [[TRAIN, TRAIN + "    decoder = model.cls.predictions.decoder  # the mistake: tied in the forward only\n"
                           "    decoder.forward = lambda x, d=decoder: F.linear(x, d.weight.detach(), d.bias)\n"]],
          BOTH),
    # --- mixed precision (bf16 only)
    plant("precision.no-master", [[UPDATE, UPDATE + "    params = params.to(torch.bfloat16).float()  # the mistake\n"]],
          needs=("bf16",)),
    # Two roundings to bf16 of each element (the bucket sent, the shard kept): at most 2^-8 of it, recorded as a
    # gradient-scale error of that size (the class is one a trace cannot see: its PASS must state it).
    plant("precision.gradient-rounded-twice",
          [[BUCKET, BUCKET.replace('"padded_length"]]\n', '"padded_length"]].bfloat16().float()\n')],
           [REDUCED, "        own.append((summed / N).bfloat16().float())\n"]], needs=("bf16",),
          size=lambda c: {"grad_scale": 2.0 ** -8}),
    # Added after the split (classes the checker's diagnoses gained), at the end so that no earlier plant's
    # second configuration, and so no earlier case's id, moves; each new case falls in the half its id's hash gives.
    plant("loss.summed-over-micro-steps", [[STEP_LOSS, "    return loss * A / N  # the mistake: A x\n"]], BOTH,
          needs=("A>1",)),
    plant("loss.forward-differs", [[DROPOUT, DROPOUT.replace(")\n", ', hidden_act="relu")\n')]], BOTH),
    plant("clipping.norm-averaged-twice", [[ALL_REDUCE_SQUARES, ALL_REDUCE_SQUARES + "    squares /= N * N\n"]]),
]

NOT_PLANTED = {  # class id: why the torch peer cannot carry it
    "precision.loss-scale-in-norm": "fp16 only (DeepSpeed's dynamic loss scale); the torch peer replays fp32 and bf16",
    "schedule.fixed-betas": "needs a trace whose scheduler sets the betas per update (DeepSpeed's OneCycle): "
                            "check-peer torch plants it on such a trace",
    "loss.divided-by-N": "the same gradient as reduction.averaged-twice, which the corpus plants",
    "state.update-not-applied": "tests/cli/checker.sh makes it from zero2's own run (the update never reaches the "
                                "weights), tests/test_hypotheses.py replays it",
    "state.group-not-updated": "the pattern of an update that reaches some tensors only: tests/cli/checker.sh's "
                               "update that never reaches the weights, per tensor",
}

# The second variant of each plant (after its base at N = 2, A = 1 or 4, fp32), in turn by the plant's place in
# PLANTS: N = 4; bf16; N = 4 in bf16; A = 4 (A = 1 where the plant needs A > 1: N = 4, A = 4).
ROTATION = [(4, 1, "fp32"), (2, 1, "bf16"), (4, 1, "bf16"), (2, 4, "fp32")]
LARGE_BUGS = ["reduction.summed", "adamw.no-bias-correction-v", "clipping.local-norm"]  # BERT-mini's default size


def bug_cases():
    cases = []
    for index, p in enumerate(PLANTS):
        needs_accumulation = "A>1" in p["needs"]
        if "bf16" in p["needs"]:
            variants = [(2, 1, "bf16"), (4, 4, "bf16") if needs_accumulation else (4, 1, "bf16")]
        else:
            base = (2, 4 if needs_accumulation else 1, "fp32")
            second = ROTATION[index % len(ROTATION)]
            if needs_accumulation:
                second = (second[0], 4, second[2]) if second[1] == 1 else (4, 4, "fp32")
            variants = [base, second]
        configs = [config(*v) for v in variants]
        if p["name"] in LARGE_BUGS:
            configs.append(config(2, 1, "fp32", "large", 4))
        for k, name in enumerate(configs):
            step = p["steps"][k % len(p["steps"])]
            cls = p["cls_at"](parse_config(name)) if p["cls_at"] else p["cls"]
            cases.append(case("bug", p["name"], name, step, p["edits"], cls,
                              p["size"](parse_config(name)) if p["size"] else {}))
    return cases


# ----------------------------------------------------------------------------
# Correct variants: implementations of the same arithmetic in other legitimate ways

CORRECT = {
    "flat": ([], FLAT),
    "zero-redundancy": ([], ("zero-redundancy",)),
    "pre-division": ([[BUCKET, BUCKET.replace('"padded_length"]]\n', '"padded_length"]] / N\n')],
                      [REDUCED, "        own.append(summed)\n"]], FLAT),
    "all-reduce-then-slice": ([[RECEIVE + SUM + REDUCED,
                                "        full = bucket.clone()\n"
                                "        dist.all_reduce(full)\n"
                                '        own.append(full[r * b["shard_length"]:(r + 1) * b["shard_length"]] / N)\n']],
                              FLAT),
    "reversed-sum": ([[SUM, "        summed = rows[N - 1].clone()\n        for j in range(N - 2, -1, -1):\n"
                            "            summed += rows[j]\n"]], FLAT),
    "fp64-norm": ([[SQUARES, "    squares = (grad.double() * grad.double()).sum()\n"]], FLAT),
    "reduce-to-owner": ([[RECEIVE + SUM + REDUCED,
                          "        for j in range(N):  # each shard reduced onto the rank that owns it\n"
                          '            part = bucket[j * b["shard_length"]:(j + 1) * b["shard_length"]].clone()\n'
                          "            dist.reduce(part, dst=j)\n"
                          "            if j == r:\n"
                          "                own.append(part / N)\n"]], FLAT),
    "bucket-norms": ([[SQUARES, "    squares, start = torch.zeros(()), 0\n"
                                "    for b in layout.buckets:  # each bucket's squares, then the buckets' sum\n"
                                '        squares += (grad[start:start + b["shard_length"]] ** 2).sum()\n'
                                '        start += b["shard_length"]\n']], FLAT),
    "textbook-adamw": ([[DENOMINATOR + UPDATE, "    m_hat = layout.exp_avg / (1 - beta1 ** step)\n"
                                               "    v_hat = layout.exp_avg_sq / (1 - beta2 ** step)\n"
                                               '    params.sub_(lr * m_hat / (v_hat.sqrt() + settings["eps"]))\n']],
                       FLAT),
    "mean-rescaled-loss": ([[LOSS_RETURN,
                             "    own = int((labels != -100).sum())  # Hugging Face's mean, rescaled to the global count\n"
                             "    if own == 0:\n"
                             "        return logits.sum() * 0\n"
                             "    mean = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)\n"
                             "    return mean * (own * world_size / max(1, selected_in_global_batch))\n"]], BOTH),
    "contiguous-micro-batches": ([[MICRO_BATCH, "        m = rank * A + a                     # rank r's own A rows\n"]],
                                 BOTH),
}

SMALL = [(2, 1, "fp32"), (4, 1, "fp32"), (2, 1, "bf16"), (4, 1, "bf16"), (2, 4, "fp32"), (4, 4, "fp32"),
         (2, 4, "bf16"), (4, 4, "bf16")]


def correct_cases():
    cases = []

    def add(variant, name, step):
        edits, _ = CORRECT[variant]
        cases.append(case("correct", variant, name, step, edits))

    for v in SMALL:  # the two steps as they are, in every small configuration
        add("flat", config(*v), "flat")
        add("zero-redundancy", config(*v), "zero-redundancy")
    for variant in ("pre-division", "all-reduce-then-slice", "reduce-to-owner", "reversed-sum", "fp64-norm",
                    "bucket-norms", "textbook-adamw"):
        for v in SMALL:
            add(variant, config(*v), "flat")
    for v in SMALL:
        add("mean-rescaled-loss", config(*v), "flat")
        add("mean-rescaled-loss", config(*v), "zero-redundancy")
    for v in SMALL[4:]:  # A = 4: the rows of a rank's micro-steps contiguous, the loss global
        add("contiguous-micro-batches", config(*v), "flat")
        add("contiguous-micro-batches", config(*v), "zero-redundancy")
    for precision in ("fp32", "bf16"):  # 120 steps, the small model
        add("flat", config(2, 1, precision, "small", 120), "flat")
        add("zero-redundancy", config(2, 1, precision, "small", 120), "zero-redundancy")
        add("textbook-adamw", config(2, 1, precision, "small", 120), "flat")
    for precision in ("fp32", "bf16"):  # BERT-mini's default size, 4 steps
        add("flat", config(2, 1, precision, "large", 4), "flat")
        add("zero-redundancy", config(2, 1, precision, "large", 4), "zero-redundancy")
    return cases


def case(kind, variant, name, step, edits, cls=None, size=None):
    label = cls if kind == "bug" else "correct." + variant
    if kind == "bug" and variant != cls:
        label = variant  # a class planted at more than one size: the plant's name (class id + size)
    return {"id": f"{label}@{name}/{step}", "kind": kind, "cls": cls, "variant": variant, "config": name, "step": step,
            "edits": edits, "size": size or {}}


def all_cases():
    cases = bug_cases() + correct_cases()
    ids = [c["id"] for c in cases]
    assert len(set(ids)) == len(ids), "a case id given twice"
    quick_bugs = {}
    for c in cases:  # --quick: each category's first class at its base configuration, and the correct basics
        if c["kind"] == "bug":
            category = BY_ID[c["cls"]]["category"]
            quick_bugs.setdefault(category, c["id"])
    quick = set(quick_bugs.values()) | {"correct.flat@n2-a1-fp32-small-s8/flat", "correct.zero-redundancy@n2-a1-fp32-small-s8/zero-redundancy",
                                        "correct.flat@n2-a1-bf16-small-s8/flat", "correct.flat@n4-a4-fp32-small-s8/flat",
                                        "correct.all-reduce-then-slice@n4-a1-fp32-small-s8/flat"}
    for c in cases:
        c["quick"] = c["id"] in quick
        c["half"] = half_of(c["id"])
    return cases


def half_of(case_id):
    """The split rule: sha256 of the id, its first byte even: dev; odd: held-out."""
    return "held-out" if hashlib.sha256(case_id.encode()).digest()[0] % 2 else "dev"


def planted_source(c):
    """The case's copy of torch_peer.py; raises ValueError naming an edit that no longer matches once."""
    with open(PEER) as f:
        source = f.read()
    for old, new in c["edits"]:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"{c['id']}: an edit matches torch_peer.py {count} times, not once: {old.strip()[:80]!r}")
        source = source.replace(old, new)
    return source


def main(argv):
    command = argv[1] if len(argv) > 1 else "list"
    cases = all_cases()
    if command == "list":
        which = argv[2] if len(argv) > 2 else "all"
        for c in cases:
            if which in ("all", c["half"]):
                print(json.dumps(c))
    elif command == "tsv":  # run.sh's input: id, config, step, precision, N, kind, quick, edits, trace flags
        which = argv[2] if len(argv) > 2 else "all"
        for c in cases:
            if which in ("all", c["half"]):
                p = parse_config(c["config"])
                print("\t".join([c["id"], c["config"], c["step"], p["precision"], str(p["world_size"]), c["kind"],
                                 "1" if c["quick"] else "0", str(len(c["edits"])),
                                 " ".join(reference_flags(c["config"]))]))
    elif command == "counts":  # the cases per half: mistakes by class and configuration, correct by variant
        for half in ("dev", "held-out"):
            mine = [c for c in cases if c["half"] == half]
            bugs = [c for c in mine if c["kind"] == "bug"]
            print(f"{half}: {len(mine)} cases, {len(bugs)} mistakes of {len({c['cls'] for c in bugs})} classes, "
                  f"{len(mine) - len(bugs)} correct")
            rows = {}
            for c in mine:
                rows.setdefault(c["variant"] if c["kind"] == "bug" else "correct." + c["variant"], []).append(
                    c["config"] + "/" + c["step"])
            for name in sorted(rows):
                print(f"  {name}: {', '.join(rows[name])}")
    elif command == "split":
        split = {"rule": "sha256(case id), its first byte: even -> dev, odd -> held-out "
                         "(tests/checker_corpus/generate.py half_of)",
                 "dev": sorted(c["id"] for c in cases if c["half"] == "dev"),
                 "held-out": sorted(c["id"] for c in cases if c["half"] == "held-out")}
        with open(os.path.join(HERE, "split.json"), "w") as f:
            json.dump(split, f, indent=1)
            f.write("\n")
        print(f"split.json: {len(split['dev'])} dev, {len(split['held-out'])} held-out")
    elif command == "plant":
        by_id = {c["id"]: c for c in cases}
        if argv[2] not in by_id:
            sys.exit(f"generate.py: no case {argv[2]!r}")
        try:
            source = planted_source(by_id[argv[2]])
        except ValueError as e:
            print(f"generate.py: broken plant: {e}", file=sys.stderr)
            sys.exit(3)
        with open(argv[3], "w") as f:
            f.write(source)
    elif command == "check":
        bad = 0
        for c in cases:
            try:
                compile(planted_source(c), c["id"], "exec")
            except (ValueError, SyntaxError) as e:
                print(f"broken: {e}")
                bad += 1
        planted = {c["cls"] for c in cases if c["kind"] == "bug"}
        missing = [k["id"] for k in CLASSES if k["id"] not in planted and k["id"] not in NOT_PLANTED]
        for k in missing:
            print(f"a taxonomy class with no plant and no reason: {k}")
        print(f"{len(cases)} cases, {bad} broken plants, {len(missing)} classes unaccounted for")
        sys.exit(1 if bad or missing else 0)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
