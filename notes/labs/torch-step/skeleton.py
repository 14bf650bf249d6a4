"""Lab torch-step: ZeRO-2's optimizer step in torch.distributed, on zero2's layout (notes/labs/torch-step).

Write sharded_step below. It replaces the torch peer's own (tests/peers/torch_peer.py --step flat), which
then replays zero2's trace at N = 2 and N = 4, and tests/check_trace.py grades the replay:

    make lab LAB=torch-step SOLUTION=my_step.py

What you have (tests/peers/torch_peer.py, FlatLayout):
    layout.world_size, layout.rank     N and r
    layout.buckets                     zero2's buckets: dicts with offset, padded_length, shard_length
    layout.grads                       [Psi_padded]: this rank's gradient (its micro-batches' sum, times N)
    layout.params                      [Psi_padded]: every parameter; the model reads views of it
    layout.own(flat)                   this rank's shard of every bucket of a flat buffer, back to back
    layout.exp_avg, layout.exp_avg_sq  [Psi_padded / N]: Adam's m and v for the own shards
    layout.decay                       [Psi_padded / N]: 1.0 where AdamW decays, 0.0 on biases and LayerNorm
    settings                           the trace's optimizer: betas, eps, weight_decay, clip
What gloo gives you on Debian's torch 1.13: dist.all_to_all_single, dist.all_gather, dist.all_reduce
(no dist.reduce_scatter, no all_gather_into_tensor).
"""
import math

import torch
import torch.distributed as dist


def sharded_step(layout, lr, step, settings):
    """One optimizer step of ZeRO-2 on zero2's layout; `step` is AdamW's t (1-based). Returns (the gradient
    norm before clipping, this rank's reduced gradient shard before clipping: [Psi_padded / N])."""
    N, r = layout.world_size, layout.rank
    shard = torch.zeros(layout.exp_avg.shape)
    # 1. Reduce-scatter, bucket by bucket: rank j gets slice j of every rank's bucket, summed in rank order,
    #    divided by N (each rank's gradient carries a factor N, as DDP's averaging expects).
    # 2. The gradient norm over every rank's shard; clip as torch.nn.utils.clip_grad_norm_ does.
    # 3. AdamW (torch.optim.AdamW's arithmetic) on the own shard of the parameters, with m and v.
    # 4. All-gather every rank's updated shard of every bucket into layout.params.
    return 0.0, shard
