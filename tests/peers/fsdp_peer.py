"""tests/peers/fsdp_peer.py: zero2's trace replayed by PyTorch's FSDP, to check FSDP's sharded step against
zero2's (notes/12, "Writing a peer for FSDP"). A second template beside tests/peers/torch_peer.py: copy it
for a peer whose model is sharded by a framework rather than by hand.

What it is. Hugging Face's BertForMaskedLM, started from the trace's initial weights, each BertLayer wrapped
as its own FSDP unit and the rest (embeddings, the MLM head) in the root unit, trained on the trace's batches
with torch.optim.AdamW at the trace's N on CPU and gloo; its trace written with tests/peers/trace_files.py,
and tests/check_trace.py compares the two. Two FSDPs:

    --fsdp 1   FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) with ShardingStrategy.SHARD_GRAD_OP:
               ZeRO-2 (P_os+g): parameters gathered for forward and kept through backward, gradients
               reduce-scattered, AdamW on each rank's shard of every unit's flat parameter.
               use_orig_params=True, so the optimizer sees the model's own parameters (two parameter
               groups: the trace's no-weight-decay names get weight decay 0) and summon_full_params
               (with_grads=True) can read the full gradients. Its names carry "_fsdp_wrapped_module.",
               which the trace does not: stripped.
    --fsdp 2   FSDP2 (torch.distributed.fsdp.fully_shard) with reshard_after_forward=False, FSDP2's ZeRO-2:
               every parameter a DTensor sharded on dim 0, gradients reduce-scattered. Names unchanged;
               p.full_tensor() and p.grad.full_tensor() read the full values.

Both record the gradient norm their own clipping returns (FSDP1's sharded-aware model.clip_grad_norm_,
torch.nn.utils.clip_grad_norm_ on FSDP2's DTensors; max_norm inf when the trace does not clip), the loss as
torch_peer.py does, and at the kept steps the full fp32 parameters after the step and the full gradient
before clipping.

FSDP2 and gloo's AVG. FSDP2 reduce-scatters fp32 and bf16 gradients with ReduceOp.AVG, and gloo's
reduce_scatter_tensor in torch 2.7.1 takes AVG and SUMS (no error, no warning): every gradient is N times
the average, and so is the norm (the checker says "the gradients were summed over the 2 ranks, not
averaged"). FSDP2's own knob for the divisor, set_reduce_scatter_divide_factor, builds NCCL's PreMulSum op,
which gloo does not refuse either: it sums and drops the factor (measured: a gradient of 4 where the average
is 2). So the peer checks, once at start, what gloo's AVG does (a reduce-scatter of ones:
1 is an average, N a sum), and where it sums divides each unit's reduce-scatter output by N in FSDP2's
all-reduce hook (FSDPModule.set_all_reduce_hook, which runs on the reduce-scatter's output when there is no
HSDP all-reduce): (g_0 + g_1) / 2, zero2's sum then division. --no-avg-workaround leaves the defect in, to
show the checker naming it. FSDP1 does not meet it: it divides by N itself (its pre- and post-divide factors,
2 and 1 at N = 2) and reduce-scatters with SUM.

Mixed precision. A bf16 trace is replayed with FSDP's mixed precision, param_dtype bfloat16 over an fp32
master (FSDP1 MixedPrecision, FSDP2 MixedPrecisionPolicy): the forward and backward in bf16 (the whole module,
as zero2's bf16, notes/08), the cross-entropy on the logits widened to fp32, the reduce-scatter in
--reduce-dtype (bf16 by default: zero2's bytes on the wire; at N = 2 gloo's bf16 sum of the two halves is the
correctly rounded sum, zero2's fp32 sum rounded once), the reduced gradient widened to fp32 for AdamW.

What it leaves out: dropout (zero2's masks are its own), fp16 (zero2's loss scaler is DeepSpeed's dynamic one;
FSDP's is ShardedGradScaler: refused), a GPU (device_id cpu, gloo), CPU offload, FULL_SHARD / stage 3
(zero2 has no P_os+g+p to hold it to), gradient accumulation with FSDP's no_sync (FSDP1) and
set_requires_gradient_sync (FSDP2) only.

Versions: torch 2.7.1, on which both FSDPs run on the CPU (an earlier trial, not repeated: FSDP2 in torch
2.5.1 wants CUDA streams, in 2.6.0 it fails in foreach_all_gather), and transformers 4.46.3: .venv-fsdp, which `make check-peer PEER=fsdp` makes.

How to run:

    mpirun -n 2 build/train_bert_mini --dropout 0 --steps 20 --trace ref [--precision bf16]
    .venv-fsdp/bin/python tests/peers/fsdp_peer.py --nproc-per-node 2 --fsdp 1 ref theirs   # or --fsdp 2
    /usr/bin/python3 tests/check_trace.py ref theirs

--nproc-per-node N starts the N ranks itself (torch_peer.launch); under torchrun (RANK set) it is one rank.
Exit status: 0 when the replay ran, 2 on a trace it cannot replay (every rank, one message from rank 0).
"""
import argparse
import contextlib
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peer import forward_backward, join_group, leave_group, micro_batch_loss  # noqa: E402
from torch_peer import refuse_what_cannot_be_replayed as torch_peer_refusal  # noqa: E402
from trace_files import PeerTrace, Trace, TraceError  # noqa: E402

FSDP1_PREFIX = "_fsdp_wrapped_module."


def trace_name(name):
    """A parameter's name as the trace writes it: FSDP1's wrapper prefixes removed (one per wrapping level)."""
    return name.replace(FSDP1_PREFIX, "")


def parameter_groups(named, settings):
    """AdamW's two groups: the trace's no-weight-decay names at weight decay 0, the rest at the trace's."""
    no_decay = set(settings["no_weight_decay"])
    return [{"params": [p for n, p in named if trace_name(n) not in no_decay], "weight_decay": settings["weight_decay"]},
            {"params": [p for n, p in named if trace_name(n) in no_decay], "weight_decay": 0.0}]


def gloo_average_sums(world_size):
    """Whether this group's reduce_scatter_tensor with ReduceOp.AVG sums instead (gloo in torch 2.7.1 does):
    every rank sends ones, so each receives 1 when AVG averages and N when it sums."""
    received = torch.zeros(1)
    dist.reduce_scatter_tensor(received, torch.ones(world_size), op=dist.ReduceOp.AVG)
    return received.item() == world_size != 1


class FSDP1Step:
    """FSDP1, SHARD_GRAD_OP (ZeRO-2), use_orig_params."""

    stage = 2

    def __init__(self, model, reference, mixed_precision):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer
        self.FSDP = FSDP
        self.model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu"),
                          use_orig_params=True,  # the model's own parameters: groups by name, full gradients
                          auto_wrap_policy=ModuleWrapPolicy({BertLayer}),
                          mixed_precision=MixedPrecision(**mixed_precision) if mixed_precision else None)
        self.forward = self.model
        settings = reference.optimizer
        self.optimizer = torch.optim.AdamW(parameter_groups(list(self.model.named_parameters()), settings), lr=0.0,
                                           betas=tuple(settings["betas"]), eps=settings["eps"])
        self.clip = settings["clip"]
        self.settings = settings

    def no_sync(self, last_micro_step):
        return contextlib.nullcontext() if last_micro_step else self.model.no_sync()

    def gradients(self):
        """The full reduced gradient by trace name (every rank takes part: summon_full_params gathers)."""
        with self.FSDP.summon_full_params(self.model, with_grads=True, writeback=False):
            return {trace_name(n): p.grad.detach().float().clone().numpy() for n, p in self.model.named_parameters()}

    def parameters(self):
        """The full fp32 parameters (the master: summon_full_params gathers the full-precision shards)."""
        with self.FSDP.summon_full_params(self.model, writeback=False):
            return {trace_name(n): p.detach().float().clone().numpy() for n, p in self.model.named_parameters()}

    def clip_grad_norm(self):
        # FSDP1's own: each rank's squares over its shards, all-reduced, the root; then the coefficient.
        return float(self.model.clip_grad_norm_(self.clip if self.clip > 0 else math.inf))


class FSDP2Step:
    """FSDP2, fully_shard with reshard_after_forward=False (ZeRO-2)."""

    stage = 2

    def __init__(self, model, reference, mixed_precision, avg_workaround):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from transformers.models.bert.modeling_bert import BertLayer
        N = dist.get_world_size()
        mesh = init_device_mesh("cpu", (N,))
        policy = MixedPrecisionPolicy(**mixed_precision) if mixed_precision else MixedPrecisionPolicy()
        for module in model.modules():
            if isinstance(module, BertLayer):
                fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        self.model = self.forward = model
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        # gloo's AVG sums (module docstring): divide each unit's reduce-scatter output by N after it.
        self.avg_workaround = avg_workaround and gloo_average_sums(N)
        if self.avg_workaround:
            for unit in self.units:
                unit.set_all_reduce_hook(lambda reduced: reduced.div_(N))
        settings = reference.optimizer
        self.optimizer = torch.optim.AdamW(parameter_groups(list(model.named_parameters()), settings), lr=0.0,
                                           betas=tuple(settings["betas"]), eps=settings["eps"])
        self.clip = settings["clip"]
        self.settings = settings

    def no_sync(self, last_micro_step):
        for unit in self.units:
            unit.set_requires_gradient_sync(last_micro_step)
        return contextlib.nullcontext()

    def gradients(self):
        return {n: p.grad.full_tensor().detach().float().clone().numpy() for n, p in self.model.named_parameters()}

    def parameters(self):
        return {n: p.full_tensor().detach().float().clone().numpy() for n, p in self.model.named_parameters()}

    def clip_grad_norm(self):
        # torch's clip_grad_norm_ on DTensor gradients: the per-tensor norms are partial sums over the shards,
        # reduced when the total is read (a DTensor, replicated: full_tensor()).
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else math.inf)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def used_optimizer(stepper):
    """The settings torch's AdamW holds, for the trace (the checker compares them with zero2's)."""
    group = stepper.optimizer.param_groups[0]
    # the betas it was built with: a OneCycle trace's steps[].betas replaced them update by update
    return {"betas": list(stepper.optimizer.defaults["betas"]), "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            "clip": stepper.clip, "no_weight_decay": sorted(stepper.settings["no_weight_decay"])}


def refuse_what_cannot_be_replayed(reference, world_size):
    problem = torch_peer_refusal(reference, world_size, ("fp32", "bf16"), "the DeepSpeed peer replays fp16")
    if problem is None and reference.run.get("offload_optimizer"):
        return "the trace's optimizer was offloaded (ZeRO-Offload); this peer replays FSDP without CPU offload"
    return problem


def replay(reference, out, args):
    import transformers
    from transformers import BertForMaskedLM
    transformers.logging.set_verbosity_error()  # 4.46's GenerationMixin notice for BertForMaskedLM, per rank
    rank, N = dist.get_rank(), dist.get_world_size()
    model = BertForMaskedLM.from_pretrained(reference.initial_directory(), hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0)
    model.train()  # dropout 0: train mode computes what eval mode would
    bf16 = reference.run["precision"] == "bf16"
    reduce_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.reduce_dtype]
    mixed_precision = {"param_dtype": torch.bfloat16, "reduce_dtype": reduce_dtype} if bf16 else None
    if args.fsdp == 1:
        stepper = FSDP1Step(model, reference, mixed_precision)
        what = "FSDP1 SHARD_GRAD_OP, use_orig_params"
    else:
        stepper = FSDP2Step(model, reference, mixed_precision, not args.no_avg_workaround)
        what = "FSDP2 fully_shard, reshard_after_forward=False" + (
            ", gloo's AVG divided by N in the all-reduce hook" if stepper.avg_workaround else
            ", no AVG workaround" if args.no_avg_workaround else "")
    if bf16:
        what += f", bf16 parameters, reduce in {args.reduce_dtype}, fp32 master"
    A, B = reference.run["accumulation_steps"], reference.run["micro_batch"]
    trace = PeerTrace(out, reference, f"tests/peers/fsdp_peer.py --fsdp {args.fsdp} ({what}), torch "
                                      f"{torch.__version__}, transformers {transformers.__version__}, {N} ranks "
                                      f"on gloo") if rank == 0 else None
    for step in range(1, len(reference.steps) + 1):
        # zero2's cross-entropy reads 16-bit logits and computes in fp32 (notes/08)
        loss = forward_backward(reference, step, stepper, lambda logits, *rest: micro_batch_loss(logits.float(), *rest))
        keep = step in reference.parameter_steps
        gradients = stepper.gradients() if keep else None   # before clipping changes them
        lr, betas = reference.steps[step - 1]["lr"], reference.steps[step - 1].get("betas")
        norm = stepper.clip_grad_norm()
        for group in stepper.optimizer.param_groups:
            group["lr"] = lr
            if betas:  # DeepSpeed's OneCycle sets each update's betas (steps[].betas)
                group["betas"] = tuple(betas)
        stepper.optimizer.step()
        stepper.optimizer.zero_grad(set_to_none=True)
        parameters = stepper.parameters() if keep else None  # every rank: gathering is collective
        if trace:
            trace.step(step, loss=float(loss), grad_norm=norm, lr=lr)
            if keep:
                trace.parameters(step, parameters, gradients)
    if trace:  # what this replay ran, which the checker holds against zero2's trace
        trace.finish(optimizer=used_optimizer(stepper), world_size=N, stage=stepper.stage, accumulation_steps=A,
                     micro_batch=B)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference", help="zero2's trace (train_bert_mini --trace DIR)")
    parser.add_argument("out", help="where this peer writes its own trace")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=1, help="FSDP1 SHARD_GRAD_OP or FSDP2")
    parser.add_argument("--no-avg-workaround", action="store_true",
                        help="FSDP2: leave gloo's AVG-that-sums in (the gradients come out N times too large)")
    parser.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="a bf16 trace: the reduce-scatter's type (default bf16, zero2's)")
    parser.add_argument("--nproc-per-node", type=int, help="start this many ranks (without torchrun)")
    args = parser.parse_args()
    rank = join_group(args.nproc_per_node)
    try:
        reference = Trace(args.reference)
        problem = refuse_what_cannot_be_replayed(reference, dist.get_world_size())
    except (TraceError, OSError) as e:
        problem = str(e)
    if problem:
        if rank == 0:
            print(f"fsdp_peer: error: {problem}", file=sys.stderr)
        leave_group()
        sys.exit(2)
    replay(reference, args.out, args)
    leave_group()


if __name__ == "__main__":
    main()
