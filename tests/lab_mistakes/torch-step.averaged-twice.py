"""A planted mistake in the torch-step lab's sharded_step (notes/labs/torch-step): the reduce-scatter divides by N, and then once more.
make check-peer PEER=torch runs tests/peers/torch_peer.py --step flat --replace on it and checks that
tests/check_trace.py fails and names it with the words of the "expect" line."""
# expect: averaged over the 2 ranks twice
import math

import torch
import torch.distributed as dist

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
        own.append(summed / N / N)  # the mistake: divided twice
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
