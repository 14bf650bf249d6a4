"""tests/peers/deepspeed_peer.py REF_TRACE OUT_TRACE [--ranks N] [--scheduler]: DeepSpeed's ZeRO replays a
zero2 trace.

    mpirun -n 2 build/train_bert_mini --dropout 0 --steps 20 --trace ref
    .venv-deepspeed/bin/python tests/peers/deepspeed_peer.py ref theirs
    /usr/bin/python3 tests/check_trace.py ref theirs

DeepSpeed's engine trains transformers' BertForMaskedLM from REF_TRACE/initial on zero2's batches, with the
trace's DeepSpeed config (run.deepspeed_config) or one built from its settings, at the trace's learning rate
every step, and writes what it did to OUT_TRACE in the trace format (tests/peers/trace_files.py). Run it with
a Python that has deepspeed, torch and transformers (`make check-peer PEER=deepspeed` makes .venv-deepspeed).
It checks the trace, then starts itself on N ranks through torchrun (the trace's N, or --ranks N: any N that
divides the trace's N x A micro-batches; tests/check_trace.py compares replays at the trace's N only).
Started by a launcher (torchrun, `deepspeed`: RANK set) it is one rank of the replay.

How the replay meets zero2's conventions (trace.json's "conventions"), each where it happens below:
  - the batch: global micro-batch m = a N + r is rank r's at its micro-step a (micro_batch_rows);
  - the loss: each micro-step's summed cross-entropy, scaled so that the gradient DeepSpeed ends with is
    that of zero2's loss (scaled_loss); not Hugging Face's labels= loss, a mean per micro-batch;
  - the learning rate: no scheduler; every parameter group gets steps[].lr before the step, and the rate
    recorded is the one torch's AdamW read (a step pre-hook). With --scheduler the config's own scheduler
    block chooses the rates instead (DeepSpeed's WarmupLR, WarmupDecayLR, ...), so the checker compares
    zero2's reading of the schedule with DeepSpeed's;
  - the gradient, the norm and the parameters: DeepSpeed's own (safe_get_full_grad before the step,
    get_global_grad_norm after it, safe_get_full_fp32_param), fp16's loss scale divided out.
On the CPU DeepSpeed runs on gloo (DS_ACCELERATOR=cpu, set here when unset) with torch's AdamW ("torch_adam":
true; without it DeepSpeed JIT-compiles its own CPU Adam); it builds its shared-memory comm op once (a minute).

What replays: ZeRO stages 0, 1, 2 in fp32 and fp16 (DeepSpeed's dynamic loss scaler, with the trace's
settings), bf16 at stages 1 and 2, any A. Refused with the reason (exit 2, before any rank starts): dropout
> 0 (zero2's masks are its own), ZeRO-Offload, an optimizer other than AdamW, AdamW without bias correction
and max_grad_norm (torch's AdamW and DeepSpeed refuse them), "auto" values the trace cannot fill, bf16 at
stage 0 (DeepSpeed's BF16_Optimizer fails on gloo), a rank count that does not divide N x A.
"""
import copy
import os
import subprocess
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_files import PeerTrace, Trace, TraceError  # noqa: E402

class Refusal(Exception):
    """What this replay cannot do, in one sentence: printed once, exit 2."""


def refuse_unless(condition, message):
    if not condition:
        raise Refusal(message)


# --- what is replayed: the trace's settings as DeepSpeed needs them --------------------------

def geometry(trace, world):
    """(B, A): DeepSpeed's micro-batch and accumulation steps at this world size. The trace's global batch is
    N x A micro-batches of B rows; any world size that divides N x A replays it."""
    run = trace.run
    micro_batches = run["world_size"] * run["accumulation_steps"]
    refuse_unless(micro_batches % world == 0,
                  f"the trace's global batch is {micro_batches} micro-batches (N = {run['world_size']} x "
                  f"A = {run['accumulation_steps']}): launch a number of ranks that divides it, not {world}")
    return run["micro_batch"], micro_batches // world


def fill_auto(config, trace):
    """Hugging Face's Trainer fills a config's "auto" values from its own arguments before DeepSpeed reads it;
    here they come from what zero2 did (the trace's optimizer and run sections). An "auto" left is refused."""
    optimizer, run = trace.optimizer, trace.run
    known = {("optimizer", "params", "betas"): optimizer["betas"], ("optimizer", "params", "eps"): optimizer["eps"],
             ("optimizer", "params", "weight_decay"): optimizer["weight_decay"],
             ("optimizer", "params", "lr"): trace.steps[0]["lr"] if trace.steps else 0.0,
             ("gradient_clipping",): optimizer["clip"],
             ("zero_optimization", "reduce_bucket_size"): run["bucket"],
             ("zero_optimization", "allgather_bucket_size"): run["bucket"]}
    left = []

    def walk(node, path):
        for key, value in list(node.items()):
            where = path + (key,)
            if isinstance(value, dict):
                walk(value, where)
            elif value == "auto":
                if where in known:
                    node[key] = known[where]
                else:
                    left.append(".".join(where))
    walk(config, ())
    return left


def deepspeed_config(trace, world, own_scheduler=False):
    """The DeepSpeed config this replay runs: the trace's own (run.deepspeed_config, the JSON zero2 read) when it
    has one, else one built from its settings; then what the replay fixes whatever the file says. Returns
    (config, where it came from). own_scheduler: the file's scheduler block stays (--scheduler)."""
    run, optimizer = trace.run, trace.optimizer
    micro_batch, accumulation = geometry(trace, world)
    if run.get("deepspeed_config"):
        config, source = copy.deepcopy(run["deepspeed_config"]), "the trace's run.deepspeed_config"
        unfilled = [key for key in fill_auto(config, trace)
                    if key not in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                   "fp16.enabled", "bf16.enabled")
                    and (own_scheduler or not key.startswith("scheduler."))]
        refuse_unless(not unfilled, f"the config's {', '.join(unfilled)} is \"auto\", which only Hugging Face's "
                                    "Trainer fills and the trace does not say")
    else:
        config = {"optimizer": {"type": "AdamW", "params": {"betas": optimizer["betas"], "eps": optimizer["eps"],
                                                            "weight_decay": optimizer["weight_decay"]}},
                  "gradient_clipping": optimizer["clip"],
                  "zero_optimization": {"stage": run["stage"], "reduce_bucket_size": run["bucket"],
                                        "overlap_comm": bool(run["overlap"])}}
        source = "built from the trace's settings"
        refuse_unless(optimizer.get("bias_correction", True),
                      "the trace's AdamW has no bias correction, which torch.optim.AdamW (DeepSpeed's optimizer "
                      "here, \"torch_adam\") always applies")

    # The batch geometry, the stage and the precision are what zero2 ran (a flag may have overridden the file).
    refuse_unless(not own_scheduler or "scheduler" in config,
                  "--scheduler: the trace has no DeepSpeed config with a scheduler block to run")
    for key in ("train_batch_size",) + (() if own_scheduler else ("scheduler",)):  # else: steps[].lr, every step
        config.pop(key, None)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = accumulation
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):  # absent, or the old boolean form (true: stage 1)
        zero = config["zero_optimization"] = {}
    zero["stage"] = run["stage"]
    # ZeRO-Offload (zero2's --offload-optimizer cpu, notes/13): DeepSpeed's offload_optimizer device cpu, its
    # fp32 partition and torch's AdamW on the host (a config optimizer with "torch_adam" passes
    # engine._configure_optimizer's DeepSpeedCPUAdam check; nothing is compiled).
    zero.pop("cpu_offload", None)
    if run.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        zero.pop("offload_optimizer", None)
    device = zero.get("offload_param")
    refuse_unless(not device or (isinstance(device, dict) and device.get("device", "none") == "none"),
                  "zero_optimization.offload_param is stage 3's: zero2 has no stage 3")
    precision = run["precision"]
    refuse_unless(precision in ("fp32", "bf16", "fp16"), f"run.precision {precision!r} is not fp32, bf16 or fp16")
    accumulate_in = (config.get("data_types") or {}).get("grad_accum_dtype")
    refuse_unless(precision != "bf16" or (run["stage"] > 0 and accumulate_in in (None, "bf16")),
                  "bf16 without ZeRO's partitioned optimizer is DeepSpeed's BF16_Optimizer (stage 0, or stage 1 with "
                  "grad_accum_dtype fp32: engine._do_optimizer_sanity_check), whose parameter all-gather fails on "
                  "gloo (torch 2.5.1: \"A view was created in no_grad mode and is being modified inplace\"); "
                  "bf16 replays at stage 1 or 2")
    for block in ("fp16", "bf16"):  # the file's other keys (the loss scaler's) stay as DeepSpeed reads them
        given = config.get(block) if isinstance(config.get(block), dict) else {}
        config[block] = dict(given, enabled=precision == block)
    if precision == "fp16" and not run.get("deepspeed_config") and trace.loss_scaling:
        # Without a file: zero2's dynamic loss scale is DeepSpeed's DynamicLossScaler, with the trace's settings.
        scaling = trace.loss_scaling
        static = scaling.get("rule") == "static"
        config["fp16"].update(loss_scale=scaling["initial_scale"] if static else 0,
                              initial_scale_power=int(scaling["initial_scale"]).bit_length() - 1,
                              loss_scale_window=scaling["window"], hysteresis=scaling["hysteresis"],
                              consecutive_hysteresis=scaling["consecutive_hysteresis"],
                              min_loss_scale=scaling["min_scale"])

    # The optimizer: AdamW as torch implements it (zero2's convention is torch.optim.AdamW's).
    opt = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
    kind = str(opt.get("type", "")).lower()
    params = opt.setdefault("params", {})
    refuse_unless(kind in ("adam", "adamw"), f"optimizer.type {opt.get('type')!r}: the trace's optimizer is AdamW")
    refuse_unless(kind == "adamw" or params.get("adam_w_mode", True),
                  "optimizer.params.adam_w_mode false is Adam with L2 decay, not the trace's AdamW")
    refuse_unless("max_grad_norm" not in params,
                  "optimizer.params.max_grad_norm: DeepSpeed 0.16.9 refuses it (engine.py, _configure_basic_optimizer: "
                  "\"please switch to using the deepspeed parameter 'gradient_clipping'\")")
    refuse_unless(params.pop("bias_correction", True),
                  "optimizer.params.bias_correction false: torch.optim.AdamW (DeepSpeed's optimizer here, "
                  "\"torch_adam\") always corrects the bias")
    params["torch_adam"] = True
    # The defaults of what DeepSpeed would build (FusedAdam, or DeepSpeedCPUAdam under offload: weight_decay 0),
    # where torch.optim.AdamW's own default is 0.01: a config without the key trains without decay.
    params.setdefault("weight_decay", 0.0)
    params.setdefault("lr", trace.steps[0]["lr"] if trace.steps else 0.0)  # replaced before every step
    config["steps_per_print"] = 1 << 30  # DeepSpeed's progress lines off
    return config, source


# --- the model, its parameter groups, the batch -------------------------------------------------

def load_model(trace, dropout=0.0):
    """transformers' BertForMaskedLM from the trace's initial/ (the Hugging Face layout zero2 exports), with
    dropout 0 for a replay (tests/peers/deepspeed_bench.py times it with dropout)."""
    from transformers import BertForMaskedLM
    model = BertForMaskedLM.from_pretrained(trace.initial_directory(), hidden_dropout_prob=dropout,
                                            attention_probs_dropout_prob=dropout)
    model.train()
    return model


def parameter_groups(model, trace, weight_decay):
    """Two groups, as zero2 decays: the trace's no_weight_decay names get weight_decay 0. DeepSpeed builds its
    optimizer from these (each group's own keys win over the config's params)."""
    no_decay = set(trace.optimizer.get("no_weight_decay", []))
    named = list(model.named_parameters())
    unknown = no_decay - {name for name, _ in named}
    refuse_unless(not unknown, f"the trace's no_weight_decay names parameters BertForMaskedLM does not have: "
                               f"{sorted(unknown)[:3]}")
    decay = [p for name, p in named if name not in no_decay]
    plain = [p for name, p in named if name in no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def micro_batch_rows(step_batch, micro_batch, world, rank, a):
    """Global micro-batch m = a N + r is rank r's at its micro-step a: rows m B .. m B + B - 1."""
    m = a * world + rank
    return step_batch[m * micro_batch:(m + 1) * micro_batch]


def scaled_loss(summed_cross_entropy, selected, world, accumulation):
    """What engine.backward gets so that DeepSpeed's gradient is that of zero2's loss.

    zero2's loss is sum(cross-entropy over every selected position of the global batch) / selected. DeepSpeed
    divides what backward gets by gradient_accumulation_steps A (engine._backward_prologue, _scale_loss_by_gas)
    and averages the ranks' gradients, dividing by N before its all-reduce (stage_1_and_2.average_tensor:
    tensor.div_(world size); stage 0 after it: engine.allreduce_bucket). Each micro-step's sum times N A / selected
    undoes both: sum over ranks and micro-steps of (N A / selected) sum / (N A) = the global sum / selected.
    A mean per micro-batch (Hugging Face's labels= loss) would weigh a position by 1 / its micro-batch's
    count instead of 1 / the global count."""
    return summed_cross_entropy * (world * accumulation / selected)


# --- the replay -------------------------------------------------------------------------------

def check(reference, world, own_scheduler=False):
    """(trace, DeepSpeed config, where the config came from), or a TraceError / Refusal: everything the ranks
    would refuse, found before any is started."""
    trace = Trace(reference)
    for key in ("world_size", "accumulation_steps", "micro_batch", "stage", "precision", "bucket"):
        trace.field("run", key)
    for key in ("betas", "eps", "weight_decay", "clip"):
        trace.field("optimizer", key)
    refuse_unless(trace.run["stage"] in (0, 1, 2), f"run.stage {trace.run['stage']} (zero2 has stages 0, 1, 2)")
    dropout = trace.run.get("dropout", 0)
    refuse_unless(dropout == 0, f"the trace ran with dropout {dropout}: zero2 draws its own masks, which no "
                                "other implementation draws (only a run with --dropout 0 can be replayed)")
    config, source = deepspeed_config(trace, world, own_scheduler)
    return trace, config, source


def launch(args):
    """Not under a launcher: check the trace here (exit 2 with the reason), then torchrun this file on N ranks.
    One thread per rank: the ranks share the cores (OpenBLAS starts its own threads otherwise)."""
    try:
        trace = Trace(args.reference)
        ranks = args.ranks or trace.run.get("world_size", 1)
        check(args.reference, ranks, args.scheduler)
    except (TraceError, Refusal) as e:
        print(f"deepspeed_peer: cannot replay {args.reference}: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(name, "1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.abspath(__file__), args.reference, args.out] + (["--scheduler"] if args.scheduler else [])
    return subprocess.call(command, env=env)


def main(argv):
    import argparse
    parser = argparse.ArgumentParser(description="DeepSpeed's ZeRO replays a zero2 trace (tests/peers/README.md)")
    parser.add_argument("reference", help="zero2's trace (train_bert_mini --trace DIR)")
    parser.add_argument("out", help="the directory this replay's trace is written to")
    parser.add_argument("--ranks", type=int, help="ranks to start (the trace's N; any divisor of its N x A)")
    parser.add_argument("--scheduler", action="store_true",
                        help="DeepSpeed's scheduler from the trace's config chooses the rates, not steps[].lr")
    args = parser.parse_args(argv[1:])
    if args.ranks is not None and args.ranks < 1:
        parser.error("--ranks must be at least 1")
    if "RANK" not in os.environ:
        return launch(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        trace, config, source = check(args.reference, world, args.scheduler)
    except (TraceError, Refusal) as e:
        if rank == 0:
            print(f"deepspeed_peer: cannot replay {args.reference}: {e}", file=sys.stderr)
        return 2
    return replay(trace, config, source, args.out, rank, world, args.scheduler)


def replay(trace, config, source, out, rank, world, own_scheduler=False):
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    import transformers
    from deepspeed.utils import logger, safe_get_full_fp32_param, safe_get_full_grad
    if not os.environ.get("DEEPSPEED_PEER_VERBOSE"):  # DeepSpeed's INFO lines (its whole config) and HF's notes
        logger.setLevel("WARNING")
        transformers.logging.set_verbosity_error()
    model = load_model(trace)
    try:
        groups = parameter_groups(model, trace, config["optimizer"]["params"].get("weight_decay", 0.01))
    except Refusal as e:
        if rank == 0:
            print(f"deepspeed_peer: cannot replay {trace.directory}: {e}", file=sys.stderr)
        return 2
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    micro_batch, accumulation = geometry(trace, world)
    stage, precision = trace.run["stage"], trace.run["precision"]

    # The rate the optimizer read: torch's own step pre-hook on the innermost optimizer (DeepSpeed's ZeRO
    # optimizer calls it once per parameter group, stage_1_and_2._optimizer_step).
    used_lr = []
    engine.basic_optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: used_lr.extend(g["lr"] for g in optimizer.param_groups))

    def loss_scale():
        """The scale backward multiplied the loss by (1 without fp16)."""
        return float(getattr(engine.optimizer, "cur_scale", 1.0)) if precision == "fp16" else 1.0

    def replicated_norm():
        """Stage 0 in fp32 keeps no norm (engine._take_model_step clips through runtime/utils.clip_grad_norm_
        and drops it, then sets the gradients to None): its formula, the square root of the sum of the
        parameters' squared norms, on the all-reduced gradients every rank holds, before the step."""
        if engine.zero_optimization() or precision != "fp32":
            return None
        return torch.stack([p.grad.detach().float().norm() for p in model.parameters()]).square().sum().sqrt()

    def grad_norm(before_step, scale):
        """DeepSpeed's norm of the whole gradient before clipping. ZeRO 1/2: stage_1_and_2.step's
        scaled_global_norm() / loss scale (get_global_grad_norm). Stage 0 in fp16 with torch's AdamW is
        FP16_UnfusedOptimizer, which keeps the norm of the scaled gradient (unfused_optimizer.py, step:
        _global_grad_norm = get_global_norm(...), where fused_optimizer.py and stage_1_and_2.py divide by
        cur_scale): divided by the scale here."""
        norm = engine.get_global_grad_norm()
        norm = float(norm if norm is not None else before_step)
        if type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer":
            norm /= scale
        return norm if np.isfinite(norm) and norm >= 0 else None  # DeepSpeed writes -1 for inf/nan

    # Where safe_get_full_fp32_param finds no master (FP16_UnfusedOptimizer, stage 0 in fp16), the wrapper's
    # own fp32 copy: fp32_groups beside fp16_groups (unfused_optimizer.py, __init__).
    masters = {id(low): high for lows, highs in zip(getattr(engine.optimizer, "fp16_groups", []),
                                                     getattr(engine.optimizer, "fp32_groups", []))
               for low, high in zip(lows, highs)}

    writer = None
    if rank == 0:
        writer = PeerTrace(out, trace, producer=f"DeepSpeed {deepspeed.__version__} ZeRO stage {stage} {precision} "
                                                f"(torch {torch.__version__}, transformers {transformers.__version__}, "
                                                f"BertForMaskedLM), {world} ranks")
    for step, record in enumerate(trace.steps, start=1):
        input_ids, labels = trace.batch(step)
        selected = int((labels != -100).sum())  # over the whole global batch: zero2's divisor
        if not own_scheduler:  # the trace's rate; else DeepSpeed's scheduler has set it (engine.step, the last)
            for group in engine.optimizer.param_groups:
                group["lr"] = record["lr"]
        planned = engine.optimizer.param_groups[0]["lr"]
        summed = torch.zeros((), dtype=torch.float64)
        for a in range(accumulation):
            ids = torch.from_numpy(micro_batch_rows(input_ids, micro_batch, world, rank, a).copy())
            target = torch.from_numpy(micro_batch_rows(labels, micro_batch, world, rank, a).copy())
            logits = engine(input_ids=ids).logits
            cross_entropy = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1),
                                            ignore_index=-100, reduction="sum")
            summed += cross_entropy.detach().double()
            engine.backward(scaled_loss(cross_entropy, selected, world, accumulation))
            if a < accumulation - 1:
                engine.step()  # DeepSpeed counts micro-steps in step(): it updates at every A-th call
        keep = step in trace.parameter_steps
        scale, norm = loss_scale(), replicated_norm()
        if keep:  # DeepSpeed's reduced gradient, whole, before the step (a collective: every rank asks)
            gradients = {name: safe_get_full_grad(p).detach().float().numpy() / scale
                         for name, p in model.named_parameters()}
        used_lr.clear()
        engine.step()
        skipped = not engine.was_step_applied()
        torch.distributed.all_reduce(summed)  # the loss: every rank's sum, divided once by the global count
        if keep:  # the fp32 master weights after the step, whole (a collective too)
            parameters = {}
            for name, p in model.named_parameters():
                full = safe_get_full_fp32_param(p)  # ZeRO 1/2: the master's pieces, gathered
                full = full if full is not None else masters.get(id(p), p)  # stage 0: the wrapper's, or p itself
                if full.dtype != torch.float32:
                    raise RuntimeError(f"no fp32 master weights found for {name} in {type(engine.optimizer)}")
                parameters[name] = full.detach().numpy()
        if not skipped and len(set(used_lr)) != 1:  # a skipped step (fp16 overflow) never reaches the optimizer
            raise RuntimeError(f"step {step}: the optimizer read the rates {sorted(set(used_lr))}, not one rate")
        if writer:
            writer.step(step, loss=float(summed) / selected, grad_norm=None if skipped else grad_norm(norm, scale),
                        lr=planned if skipped else used_lr[0], loss_scale=scale, skipped=skipped)
            if keep:
                writer.parameters(step, parameters, gradients if trace.parameter_steps[step] else None)
    if writer:
        adamw = engine.basic_optimizer.param_groups[0]  # the decaying group: what the optimizer was built with
        # the betas it was built with (DeepSpeed's OneCycle replaces the group's every update)
        writer.finish(optimizer={"betas": list(engine.basic_optimizer.defaults["betas"]), "eps": adamw["eps"],
                                 "weight_decay": adamw["weight_decay"], "bias_correction": True,
                                 "clip": float(engine.gradient_clipping())},
                      world_size=world, accumulation_steps=accumulation,
                      bucket=int(engine.zero_reduce_bucket_size()) if stage > 0 else trace.run["bucket"],
                      overlap=bool(engine.zero_overlap_comm()) if stage > 0 else trace.run["overlap"],
                      offload_optimizer=bool(engine.zero_cpu_offload()),  # what DeepSpeed ran, not what was asked
                      deepspeed_config=config, deepspeed_config_source=source,
                      learning_rate="DeepSpeed's scheduler" if own_scheduler else "the trace's steps[].lr")
        print(f"deepspeed_peer: {len(trace.steps)} steps replayed by DeepSpeed {deepspeed.__version__} "
              f"(ZeRO stage {stage}{', the optimizer offloaded to the CPU' if engine.zero_cpu_offload() else ''}, "
              f"{precision}, {world} rank{'s' if world > 1 else ''}; config {source}) into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
