"""tests/peers/deepspeed_bench.py TRACE --stage S --json OUT [--dropout P] [--comms] [--ranks N]: DeepSpeed's
side of tests/peers/side_by_side.sh. Trains transformers' BertForMaskedLM from TRACE/initial on the trace's
batches and learning rates, as deepspeed_peer.py replays it (the same config, loss and batch split), but with
the dropout given and ZeRO stage S, and writes what it measured to OUT (JSON, rank 0):

  step_ms        every step's wall time on rank 0 (from the end of the step before; step 1 from the start)
  rss_kib        per rank, [resident, peak resident] in KiB (the kernel's VmRSS and VmHWM) at four points:
                 Python started, torch + deepspeed + transformers imported, the engine built, the end
  model_states   the bytes of the tensors DeepSpeed holds for the model's states on rank 0 after the last
                 backward (storages counted once): the module's parameters, the fp32 partition, the gradient
                 partition and reduce buckets (ZeRO), the gradients (stage 0), AdamW's m and v
  estimator      deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs for this model
                 and N (its "all_live" form: the parameters counted by model_to_params)
  comm           with --comms: DeepSpeed's comms logger ("comms_logger" in the config) over steps 2 .. S:
                 per collective, calls and message bytes per step as the logger counts them (the tensor
                 each call was given); without --comms the logger is off (it synchronizes after every call)

One thread per rank (torch.set_num_threads(1); OMP_NUM_THREADS and OPENBLAS_NUM_THREADS 1 when launched
here). Run with .venv-deepspeed's Python; it starts itself on the trace's N ranks through torchrun.
"""
import json
import os
import sys
import time


def memory_kib():
    """(resident now, peak resident) of this process in KiB: VmRSS and VmHWM of /proc/self/status. Not
    getrusage's ru_maxrss: Linux carries the parent's high-water mark across fork and exec, so every rank
    would start at torchrun's own ~370 MB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


RSS = {"python": memory_kib()}
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_peer as peer  # noqa: E402
from trace_files import Trace  # noqa: E402

USAGE = "usage: deepspeed_bench.py TRACE --stage S --json OUT [--dropout P] [--comms] [--ranks N]"


def parse(argv):
    import argparse
    parser = argparse.ArgumentParser(usage=USAGE)
    parser.add_argument("trace")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2), required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--comms", action="store_true")
    parser.add_argument("--ranks", type=int)
    return parser.parse_args(argv[1:])


def state_bytes(engine, model):
    """Bytes of the storages behind DeepSpeed's model states on this rank, each storage once, by kind."""
    import torch
    seen, kinds = set(), {}

    def count(kind, tensors):
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            kinds[kind] = kinds.get(kind, 0) + storage.nbytes()

    zero = engine.optimizer
    count("parameters (the module's, full)", list(model.parameters()))
    count("fp32 partition (the optimizer's copy)", getattr(zero, "single_partition_of_fp32_groups", []))
    # ZeRO 1/2: the reduced gradient of the own partition (views of grads_in_partition, which
    # _release_ipg_buffers lets go of after each backward; the reduce buckets, ipg_buffer, live during
    # backward only and are not counted here).
    count("gradient partition", [t for ts in (getattr(zero, "averaged_gradients", None) or {}).values() if ts
                                 for t in ts])
    count("gradients (full)", [p.grad for p in model.parameters()])
    count("AdamW m, v", [t for state in engine.basic_optimizer.state.values() for t in state.values()])
    return kinds


def main(argv):
    args = parse(argv)
    trace = Trace(args.trace)
    if "RANK" not in os.environ:  # start the ranks, one thread each
        env = dict(os.environ)
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(name, "1")
        import subprocess
        ranks = args.ranks or trace.run["world_size"]
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={ranks}", os.path.abspath(__file__)] + argv[1:], env=env)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch
    import torch.nn.functional as F
    import deepspeed
    import transformers
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs, model_to_params
    from deepspeed.utils import logger
    RSS["imported"] = memory_kib()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logger.setLevel("WARNING")
    transformers.logging.set_verbosity_error()

    config, _ = peer.deepspeed_config(trace, world)
    config["zero_optimization"]["stage"] = args.stage
    if args.comms:
        config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    model = peer.load_model(trace, dropout=args.dropout)
    groups = peer.parameter_groups(model, trace, config["optimizer"]["params"].get("weight_decay", 0.01))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    RSS["initialized"] = memory_kib()
    micro_batch, accumulation = peer.geometry(trace, world)
    from deepspeed.comm import comms_logger

    step_ms, states, last = [], None, time.perf_counter()
    for step, record in enumerate(trace.steps, start=1):
        if step == 2 and args.comms:
            comms_logger.comms_dict.clear()  # step 1 is DeepSpeed's first (buffers made); count steps 2 .. S
        input_ids, labels = trace.batch(step)
        selected = int((labels != -100).sum())
        for group in engine.optimizer.param_groups:
            group["lr"] = record["lr"]
        for a in range(accumulation):
            ids = torch.from_numpy(peer.micro_batch_rows(input_ids, micro_batch, world, rank, a).copy())
            target = torch.from_numpy(peer.micro_batch_rows(labels, micro_batch, world, rank, a).copy())
            logits = engine(input_ids=ids).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), ignore_index=-100,
                                   reduction="sum")
            engine.backward(peer.scaled_loss(loss, selected, world, accumulation))
            if step == len(trace.steps) and a == accumulation - 1:
                states = state_bytes(engine, model)
            engine.step()
        now = time.perf_counter()
        step_ms.append((now - last) * 1e3)
        last = now
    RSS["end"] = memory_kib()

    comm = None
    if args.comms:
        steps = len(trace.steps) - 1
        comm = {name: {"calls_per_step": sum(v[0] for v in sizes.values()) / steps,
                       "message_bytes_per_step": sum(size * v[0] for size, v in sizes.items()) / steps,
                       "sizes": {str(size): v[0] for size, v in sizes.items()}}
                for name, sizes in comms_logger.comms_dict.items()}
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, RSS)
    if rank == 0:
        psi = model_to_params(model)
        cpu_bytes, gpu_bytes = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=world, num_nodes=1,
                                                                     cpu_offload=False)
        result = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__, "stage": args.stage, "world_size": world,
                  "dropout": args.dropout, "tokens_per_step": int(trace.batch(1)[0].size), "step_ms": step_ms,
                  "rss_kib": everyone, "model_states": states,
                  "estimator": {"psi": psi, "per_gpu_bytes": gpu_bytes, "per_cpu_bytes": cpu_bytes,
                                "formula": "2 Psi + int(18 Psi / N) per GPU; Psi x 4 x N x 1.5 per CPU"},
                  "comm": comm}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
