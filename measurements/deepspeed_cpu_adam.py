"""measurements/deepspeed_cpu_adam.py — DeepSpeedCPUAdam.step alone, timed, the
peer of measurements/host_adam_bench.cpp (`make bench-host-adam`, measurements/host_adam.sh):
one fp32 parameter of ELEMENTS elements with an fp32 gradient, as DeepSpeed's
ZeRO-Offload keeps its host partition (deepspeed 0.16.9,
runtime/zero/stage_1_and_2.py: the fp32 partition and its fp32 gradient on
the host, stepped by ops/adam/cpu_adam.py's DeepSpeedCPUAdam, AVX-512 or AVX2
and OpenMP). Run it in DeepSpeed's venv with OMP_NUM_THREADS=THREADS (its
OpenMP loop reads that) and DS_ACCELERATOR=cpu:

  OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv-deepspeed/bin/python measurements/deepspeed_cpu_adam.py 1e7 1

prints one line, `deepspeed fp32 ELEMENTS THREADS BEST_MS BYTES`, as the C++
bench does: the fastest of REPEATS (30) steps after 3 untimed ones, and the
28 bytes per element its step reads and writes (param, m, v read and
written, the gradient read).
"""
import sys
import time

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

elements, threads = int(float(sys.argv[1])) // 32 * 32, int(sys.argv[2])
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 30
torch.set_num_threads(threads)
x = (torch.arange(elements, dtype=torch.int64) * 2654435761 % 1000003).float() / 1000003 - 0.5
param = torch.nn.Parameter(x.clone())
param.grad = 1e-2 * x
# AdamW as the engine's bench: lr 1e-4, weight decay 0.01, torch's betas and eps.
optimizer = DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01, adamw_mode=True)
times = []
for step in range(repeats + 3):
    start = time.perf_counter()
    optimizer.step()
    if step >= 3:
        times.append((time.perf_counter() - start) * 1e3)
print(f"deepspeed fp32 {elements} {threads} {min(times):.4f} {elements * 28}")
