"""tests/peers/torch_peer.py: zero2's trace replayed by PyTorch, to check PyTorch's ZeRO against zero2's
(notes/12). Copy it as the template for your own implementation's peer.

What it is. Hugging Face's BertForMaskedLM, started from the trace's initial weights, trained on the trace's
batches with the trace's settings, at the trace's N, on gloo; every step's loss, gradient norm and learning
rate, and the parameters and gradients after the steps the trace keeps, written as a trace of its own
(tests/peers/trace_files.py). tests/check_trace.py then compares the two. Two ways to shard the step:

    --step zero-redundancy   DDP (an all-reduce that averages the ranks' gradients) and
                             torch.distributed.optim.ZeroRedundancyOptimizer over torch.optim.AdamW: PyTorch's
                             own P_os (ZeRO stage 1: each rank keeps Adam's state for some whole parameters
                             and broadcasts them after its step). The default.
    --step flat              zero2's P_os+g in a dozen lines of torch.distributed: the parameters in zero2's
                             padded flat layout (the trace's `layout`), each bucket reduce-scattered (an
                             all-to-all of slices, each rank summing its slice of every rank's bucket in rank
                             order), AdamW on the own shard, the shards all-gathered. sharded_step below; the
                             course lab "torch-step" asks a student to write it (notes/labs/torch-step).

--precision bf16 replays a bf16 trace as mixed precision over an fp32 master (what FSDP's MixedPrecision and
DeepSpeed's bf16 do, in the form Debian's torch 1.13 has on the CPU): the model's parameters stay fp32 and are
the master copy, the forward and backward run under torch.autocast("cpu", dtype=torch.bfloat16) (its matrix
products in bf16 from bf16 copies of the weights; the embeddings, LayerNorm and softmax as autocast leaves them,
in fp32), the cross-entropy on the logits widened to fp32, the gradients come out fp32 and are reduced in fp32,
and AdamW steps the fp32 master. Either --step.

What it leaves out: dropout (zero2 draws its masks from its own hash, so a trace with dropout > 0 is refused),
fp16 (the DeepSpeed peer replays it), gradient accumulation with DDP's no_sync only.

How to run (the Hugging Face venv that `make test` makes: Debian's torch 1.13 and transformers 4.39.3):

    mpirun -n 2 build/train_bert_mini --dropout 0 --steps 20 --trace ref
    .venv-hf/bin/python tests/peers/torch_peer.py --nproc-per-node 2 ref theirs [--step zero-redundancy|flat]
    /usr/bin/python3 tests/check_trace.py ref theirs                   # or: make check-trace REF=ref THEIRS=theirs

--nproc-per-node N starts the N ranks itself (Debian's torch 1.13 torchrun fails on Python 3.11: its
redirect option's enum no longer compares); under torchrun (RANK set) it is one rank of those.

--replace FILE takes sharded_step and/or micro_batch_loss from FILE instead of the definitions below (a
student's step in the lab; a planted bug in tests/lab_mistakes/torch-step.*.py).
Exit status: 0 when the replay ran, 2 on a trace it cannot replay (every rank, one message from rank 0).
"""
import argparse
import contextlib
import importlib.util
import math
import os
import socket
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_files import PeerTrace, Trace, TraceError  # noqa: E402


# ----------------------------------------------------------------------------
# The loss: zero2's convention (the trace's conventions.loss)

def micro_batch_loss(logits, labels, selected_in_global_batch, world_size):
    """This micro-batch's part of zero2's loss, times N: its selected positions' cross-entropy summed, over the
    count of the WHOLE global batch (every rank's micro-batches). Hugging Face's own loss is the mean over the
    micro-batch's positions; DDP then averages the ranks' gradients, which the factor N undoes, so the sum of
    every rank's part is zero2's loss: the mean over all selected positions of the global batch."""
    summed = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100, reduction="sum")
    return summed * world_size / max(1, selected_in_global_batch)  # none selected: a zero loss, as zero2's


# ----------------------------------------------------------------------------
# zero2's layout: the flat padded buffer, buckets, shards (the trace's `layout`; zero2.cu, "Layout")

class FlatLayout:
    """The parameters in one padded flat buffer, as zero2 lays them out at this N: parameter p at its `offset`,
    grouped into buckets, each bucket padded to N equal shards; rank r owns [offset + r*shard, offset +
    (r+1)*shard) of every bucket. Padding stays zero. Views of the buffer become the model's parameters."""

    def __init__(self, layout, model, rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.buckets = layout["buckets"]
        self.params = torch.zeros(layout["psi_padded"])           # [Psi_padded]: every rank holds all of it
        self.grads = torch.zeros(layout["psi_padded"])
        named = dict(model.named_parameters())
        self.entries = []                                          # (parameter, offset, numel, decay)
        for p in layout["parameters"]:
            tensor = named[p["name"]]
            self.params[p["offset"]:p["offset"] + p["numel"]] = tensor.detach().reshape(-1)
            tensor.data = self.params[p["offset"]:p["offset"] + p["numel"]].view(tensor.shape)
            self.entries.append((tensor, p["offset"], p["numel"], p["decay"]))
        decay = torch.zeros(layout["psi_padded"])
        for _, offset, numel, decays in self.entries:
            decay[offset:offset + numel] = 1.0 if decays else 0.0
        self.decay = self.own(decay)                               # [Psi_padded / N]: 1 where AdamW decays
        self.exp_avg = torch.zeros_like(self.decay)                # Adam's m and v: the own shards only (P_os)
        self.exp_avg_sq = torch.zeros_like(self.decay)

    def own(self, flat):
        """This rank's shard of every bucket of a flat buffer, back to back ("shard space")."""
        return torch.cat([flat[b["offset"] + self.rank * b["shard_length"]:
                               b["offset"] + (self.rank + 1) * b["shard_length"]] for b in self.buckets])

    def gather_gradients(self):
        """Each parameter's gradient (this rank's micro-batches) into the flat gradient buffer."""
        for tensor, offset, numel, _ in self.entries:
            self.grads[offset:offset + numel] = tensor.grad.reshape(-1)
            tensor.grad = None


def sharded_step(layout, lr, step, settings):
    """One optimizer step of ZeRO-2 (P_os+g) on zero2's layout. `layout.grads` holds this rank's gradient
    (its micro-batches' sum, times N: DDP's convention, see micro_batch_loss); `settings` the trace's
    optimizer section (betas, eps, weight_decay, clip); `step` AdamW's t (1-based). Updates layout.params (every
    parameter, on every rank) and returns (the gradient norm and this rank's reduced shard, before clipping)."""
    N, r = layout.world_size, layout.rank
    beta1, beta2 = settings["betas"]
    # 1. Reduce-scatter, bucket by bucket: rank j receives slice j of every rank's bucket and sums the N
    #    slices in rank order (for N = 2 that is zero2's tree, (0 + 1)); / N as DDP averages.
    own = []
    for b in layout.buckets:
        bucket = layout.grads[b["offset"]:b["offset"] + b["padded_length"]]
        received = torch.empty_like(bucket)                 # [N, shard]: row j is rank j's slice r
        dist.all_to_all_single(received, bucket)
        rows = received.view(N, b["shard_length"])
        summed = rows[0].clone()
        for j in range(1, N):
            summed += rows[j]
        own.append(summed / N)
    grad = torch.cat(own)                                   # [Psi_padded / N]: only the own shard is kept
    # 2. The global norm: every rank's squares summed before the root.
    squares = (grad * grad).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    clip = settings["clip"]
    clipped = grad * min(1.0, clip / (norm + 1e-6)) if clip > 0 else grad  # clip_grad_norm_'s coefficient
    # 3. AdamW on the own shard (torch.optim.AdamW's arithmetic), then
    params = layout.own(layout.params)
    layout.exp_avg.mul_(beta1).add_(clipped, alpha=1 - beta1)
    layout.exp_avg_sq.mul_(beta2).addcmul_(clipped, clipped, value=1 - beta2)
    params.mul_(1 - lr * settings["weight_decay"] * layout.decay)
    denominator = (layout.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(settings["eps"])
    params.addcdiv_(layout.exp_avg, denominator, value=-lr / (1 - beta1 ** step))
    # 4. All-gather: every rank's updated shard of every bucket into everyone's full buffer.
    start = 0
    for b in layout.buckets:
        shards = [torch.empty(b["shard_length"]) for _ in range(N)]
        dist.all_gather(shards, params[start:start + b["shard_length"]].contiguous())
        layout.params[b["offset"]:b["offset"] + b["padded_length"]] = torch.cat(shards)
        start += b["shard_length"]
    return norm, grad


# ----------------------------------------------------------------------------
# PyTorch's own: DDP + ZeroRedundancyOptimizer

class ZeroRedundancyStep:
    def __init__(self, model, reference):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        settings = reference.optimizer
        no_decay = set(settings["no_weight_decay"])
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": settings["weight_decay"]},
                  {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
        self.model = model
        self.forward = DistributedDataParallel(model)     # averages the ranks' gradients in backward
        self.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=0.0,
                                                 betas=tuple(settings["betas"]), eps=settings["eps"])
        self.clip = settings["clip"]
        self.no_decay_names = sorted(no_decay)

    stage = 1  # ZeroRedundancyOptimizer shards the optimizer state; DDP keeps every gradient whole

    def used_optimizer(self):
        """The settings torch's AdamW holds, for the trace (the checker compares them with zero2's)."""
        group = self.optimizer.param_groups[0]
        # the betas it was built with: a OneCycle trace's steps[].betas replaced them update by update
        return {"betas": list(self.optimizer.defaults["betas"]), "eps": group["eps"],
                "weight_decay": group["weight_decay"], "clip": self.clip, "no_weight_decay": self.no_decay_names}

    def no_sync(self, last_micro_step):
        return contextlib.nullcontext() if last_micro_step else self.forward.no_sync()

    def gradients(self):
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    betas = None  # this update's (beta1, beta2) where the trace's scheduler sets them (steps[].betas)

    def step(self, lr, step):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if self.betas:  # torch's AdamW reads the group's betas every step, its bias corrections too
                group["betas"] = tuple(self.betas)
        # The norm of the averaged gradient (every rank holds all of it after DDP); max_norm inf: norm only.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


class FlatStep:
    def __init__(self, model, reference, step_function):
        self.model, self.forward = model, model
        self.layout = FlatLayout(reference.layout, model, dist.get_rank(), dist.get_world_size())
        self.settings, self.step_function = reference.optimizer, step_function
        self.reduced = None

    stage = 2  # the gradient too is kept only as the own shard

    def used_optimizer(self):
        return {key: self.settings[key] for key in ("betas", "eps", "weight_decay", "clip")}

    def no_sync(self, last_micro_step):
        return contextlib.nullcontext()   # nothing is reduced during backward: the step reduce-scatters

    def gradients(self):
        return None   # the reduced gradient exists only after the step: gathered_gradients()

    betas = None  # this update's (beta1, beta2) where the trace's scheduler sets them (steps[].betas)

    def step(self, lr, step):
        self.layout.gather_gradients()
        settings = dict(self.settings, betas=list(self.betas)) if self.betas else self.settings
        norm, self.reduced = self.step_function(self.layout, lr, step, settings)
        return norm

    def gathered_gradients(self):
        """Every rank's reduced shard into the full layout, by parameter name (the trace's gradients)."""
        N = self.layout.world_size
        shards = [torch.empty_like(self.reduced) for _ in range(N)]
        dist.all_gather(shards, self.reduced)
        flat, start = torch.zeros_like(self.layout.params), 0
        for b in self.layout.buckets:
            for j in range(N):
                begin = b["offset"] + j * b["shard_length"]
                flat[begin:begin + b["shard_length"]] = shards[j][start:start + b["shard_length"]]
            start += b["shard_length"]
        return {tensor_name: flat[offset:offset + numel].view(tensor.shape)
                for tensor_name, (tensor, offset, numel, _) in zip(self.names(), self.layout.entries)}

    def names(self):
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id[id(tensor)] for tensor, _, _, _ in self.layout.entries]


# ----------------------------------------------------------------------------
# The replay

def refuse_what_cannot_be_replayed(reference, world_size, precisions=("fp32",), elsewhere="the DeepSpeed peer replays bf16"):
    """Why this trace cannot be replayed by a peer of `precisions` at `world_size` ranks, or None. elsewhere:
    which peer replays the other precisions."""
    run, optimizer = reference.run, reference.optimizer
    if run["world_size"] != world_size:
        return f"the trace was made at N = {run['world_size']}; run this peer with --nproc-per-node {run['world_size']}"
    if run["dropout"] != 0:
        return (f"the trace's dropout is {run['dropout']}: zero2's masks come from its own hash, which torch does not "
                f"draw; trace a run with --dropout 0")
    if run["precision"] not in precisions:
        return f"the trace is {run['precision']}; this peer replays {' and '.join(precisions)} ({elsewhere})"
    if not optimizer["bias_correction"]:
        return "the trace's AdamW has no bias correction; torch.optim.AdamW always corrects"
    return None


def load_replacements(path):
    """sharded_step and/or micro_batch_loss from a file (a student's, or a planted bug)."""
    spec = importlib.util.spec_from_file_location("replacement", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in ("sharded_step", "micro_batch_loss") if hasattr(module, name)}


def forward_backward(reference, step, stepper, loss_of, precision="fp32"):
    """Step `step`'s forward and backward on this rank's micro-batches, the gradients left in the model (or,
    through stepper.no_sync, reduced at the last micro-step); returns the step's loss, zero2's: every rank's
    parts summed, averaged over the ranks (each part carries N, DDP's convention: micro_batch_loss).
    loss_of(logits, labels, selected_in_global_batch, world_size) is micro_batch_loss or a replacement.
    precision "bf16": the forward and backward under CPU autocast to bf16 (the parameters, their gradients and
    the loss stay fp32; the logits are widened to fp32 for the cross-entropy)."""
    rank, N = dist.get_rank(), dist.get_world_size()
    A, B = reference.run["accumulation_steps"], reference.run["micro_batch"]
    input_ids, labels = (torch.from_numpy(np.array(a)) for a in reference.batch(step))
    selected = int((labels != -100).sum())
    loss = torch.zeros(())
    for a in range(A):
        m = a * N + rank                     # the micro-batch zero2's rank r computes at micro-step a
        rows = slice(m * B, (m + 1) * B)
        with stepper.no_sync(a == A - 1), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = stepper.forward(input_ids=input_ids[rows]).logits.float()
            part = loss_of(logits, labels[rows], selected, N)
            part.backward()
        loss += part.detach()
    dist.all_reduce(loss)
    return loss / N                          # what DDP's averaged loss is: the ranks' mean


def replay(reference, out, step_kind, functions, precision="fp32"):
    from transformers import BertForMaskedLM
    rank, N = dist.get_rank(), dist.get_world_size()
    model = BertForMaskedLM.from_pretrained(reference.initial_directory(), hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0)
    model.train()  # dropout 0: train mode computes what eval mode would
    if precision == "bf16":
        # torch 1.13's CPU autocast leaves layer_norm uncast, and refuses a bf16 input with fp32 weights (the
        # MLM head's transform: a bf16 GELU into its LayerNorm): LayerNorm in fp32, as autocast means it to be.
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.register_forward_pre_hook(lambda _, inputs: tuple(x.float() for x in inputs))
    stepper = (ZeroRedundancyStep(model, reference) if step_kind == "zero-redundancy"
               else FlatStep(model, reference, functions["sharded_step"]))
    A, B = reference.run["accumulation_steps"], reference.run["micro_batch"]
    trace = PeerTrace(out, reference, f"tests/peers/torch_peer.py --step {step_kind} --precision {precision}, "
                                      f"torch {torch.__version__}, {N} ranks on gloo") if rank == 0 else None
    for step in range(1, len(reference.steps) + 1):
        loss = forward_backward(reference, step, stepper, functions["micro_batch_loss"], precision)
        keep = step in reference.parameter_steps
        gradients = stepper.gradients() if keep and step_kind == "zero-redundancy" else None
        lr = reference.steps[step - 1]["lr"]
        stepper.betas = reference.steps[step - 1].get("betas")  # DeepSpeed's OneCycle cycles beta1 per step
        norm = stepper.step(lr, step)
        if keep and step_kind == "flat":
            gradients = stepper.gathered_gradients()
        if trace:
            trace.step(step, loss=float(loss), grad_norm=norm, lr=lr)
            if keep:
                trace.parameters(step, {n: p.detach().numpy() for n, p in model.named_parameters()},
                                 {n: g.numpy() for n, g in gradients.items()})
    if trace:  # what this replay ran, which the checker holds against zero2's trace
        trace.finish(optimizer=stepper.used_optimizer(), world_size=N, stage=stepper.stage,
                     accumulation_steps=A, micro_batch=B, precision=precision)


def launch(ranks):
    """Start `ranks` copies of this script as the ranks of one gloo group (what torchrun does): rank 0's
    address and a free port in their environment; the first to fail ends the others."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    children = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        children.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    status = 0
    while children:
        for child in list(children):
            code = child.poll()
            if code is None:
                continue
            children.remove(child)
            if code != 0 and status == 0:
                status = code
                for other in children:
                    other.terminate()
        if children:
            try:
                children[0].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    sys.exit(status)


def join_group(ranks):
    """This process as one rank of a gloo group: without torchrun (no RANK), start `ranks` copies of this script
    first (launch, which does not return here); one thread per rank, the ranks sharing the cores."""
    if "RANK" not in os.environ:
        launch(ranks or 1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank()


def leave_group():
    """Every rank leaves together, after rank 0 has written the trace: a gloo group torn down while another
    rank is still at work has ended a run with "terminate called without an active exception" (the FSDP peer
    once in ~60 runs; this peer once, in CI, at BERT-mini's default size)."""
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference", help="zero2's trace (train_bert_mini --trace DIR)")
    parser.add_argument("out", help="where this peer writes its own trace")
    parser.add_argument("--step", choices=("zero-redundancy", "flat"), default="zero-redundancy")
    parser.add_argument("--replace", help="a file defining sharded_step and/or micro_batch_loss")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="the trace's precision: bf16 is mixed precision over an fp32 master (autocast)")
    parser.add_argument("--nproc-per-node", type=int, help="start this many ranks (without torchrun)")
    args = parser.parse_args()
    rank = join_group(args.nproc_per_node)
    functions = {"sharded_step": sharded_step, "micro_batch_loss": micro_batch_loss}
    try:
        reference = Trace(args.reference)
        problem = refuse_what_cannot_be_replayed(reference, dist.get_world_size(), (args.precision,),
                                                 "--precision fp32 or bf16 replays that; fp16: the DeepSpeed peer")
        if problem is None and args.replace:
            functions.update(load_replacements(args.replace))
    except (TraceError, OSError, SyntaxError) as e:
        problem = str(e)
    if problem:
        if rank == 0:
            print(f"torch_peer: error: {problem}", file=sys.stderr)
        leave_group()
        sys.exit(2)
    replay(reference, args.out, args.step, functions, args.precision)
    leave_group()


if __name__ == "__main__":
    main()
