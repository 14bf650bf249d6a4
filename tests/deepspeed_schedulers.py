"""DeepSpeed 0.16.9's WarmupCosineLR, OneCycle and LRRangeTest, transcribed
from deepspeed/runtime/lr_schedules.py at tag v0.16.9 (line numbers below),
method by method, for tests/cli/deepspeed_configs.sh: it steps them on a stand-in
optimizer as DeepSpeed's engine does (the constructor sets update 1's rate,
engine.py _take_model_step calls step() after each applied update, :2322)
and compares each step's lr, and OneCycle's betas, with a trainer run's --json.
Independent of trainer/settings.cpp: Python's own math.cos / math.log, and
DeepSpeed's control flow as written, list-per-group and all. (No torch or
DeepSpeed is needed: only the param_groups and defaults the classes read.)

usage: python3 deepspeed_schedulers.py RUN.json TYPE PARAMS_JSON OPTIMIZER_LR
prints "ok" or the differences.
"""
import json
import math
import sys


class Optimizer:  # what get_torch_optimizer returns: FusedAdam's groups and defaults
    def __init__(self, lr, betas):
        self.param_groups = [{"lr": lr, "betas": betas}]
        self.defaults = {"lr": lr, "betas": betas}


def update_lr(param_groups, lrs):  # :250-253
    for param_group, lr in zip(param_groups, lrs):
        param_group['lr'] = lr
    return [group['lr'] for group in param_groups]


class LRRangeTest:  # :273-368
    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        self.optimizer = optimizer
        self.min_lr = [lr_range_test_min_lr] * len(self.optimizer.param_groups)  # :328
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.last_batch_iteration = last_batch_iteration
        self.staircase = lr_range_test_staircase
        self.interval_fn = self._staircase_interval if lr_range_test_staircase else self._continuous_interval
        if last_batch_iteration == -1:  # :336-337
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _staircase_interval(self):  # :339-340
        return math.floor(float(self.last_batch_iteration + 1) / self.step_size)

    def _continuous_interval(self):  # :342-343
        return float(self.last_batch_iteration + 1) / self.step_size

    def _get_increase(self):  # :345-346
        return (1 + self.step_rate * self.interval_fn())

    def get_lr(self):  # :348-350
        lr_increase = self._get_increase()
        return [lr_range_test_min_lr * lr_increase for lr_range_test_min_lr in self.min_lr]

    def step(self, batch_iteration=None):  # :358-362
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())


class OneCycle:  # :371-630
    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.,
                 last_batch_iteration=-1):
        self.optimizer = optimizer
        self._initialize_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                               cycle_second_stair_count, decay_step_size)
        self._initialize_lr(self.optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate, last_batch_iteration)
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._initialize_momentum(self.optimizer, cycle_min_mom, cycle_max_mom, decay_mom_rate,
                                      last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _initialize_cycle(self, cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                          cycle_second_stair_count, decay_step_size):  # :475-492
        cycle_first_step_size = float(cycle_first_step_size)
        cycle_second_step_size = float(
            cycle_second_step_size) if cycle_second_step_size is not None else cycle_first_step_size
        self.total_size = cycle_first_step_size + cycle_second_step_size
        self.step_ratio = cycle_first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        if math.isclose(self.decay_step_size, 0):
            self.skip_lr_decay = True
            self.skip_mom_decay = True
        else:
            self.skip_lr_decay = False
            self.skip_mom_decay = False

    def _initialize_lr(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate, last_batch_iteration):  # :495-505
        self.min_lrs = [cycle_min_lr] * len(optimizer.param_groups)
        if last_batch_iteration == -1:
            for lr, group in zip(self.min_lrs, optimizer.param_groups):
                group['lr'] = lr
        self.max_lrs = [cycle_max_lr] * len(optimizer.param_groups)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True

    def _initialize_momentum(self, optimizer, cycle_min_mom, cycle_max_mom, decay_mom_rate,
                             last_batch_iteration):  # :508-526
        if 'betas' not in optimizer.defaults:
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = [(cycle_min_mom, 0.99)] * len(optimizer.param_groups)
        self.max_moms = [(cycle_max_mom, 0.99)] * len(optimizer.param_groups)
        if last_batch_iteration == -1:
            for momentum, group in zip(self.min_moms, optimizer.param_groups):
                group['betas'] = momentum
        if math.isclose(self.decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _get_scale_factor(self):  # :528-537
        batch_iteration = (self.last_batch_iteration + 1)
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1. + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
        return scale_factor

    def _get_cycle_mom(self):  # :539-548
        scale_factor = self._get_scale_factor()
        momentums = []
        for base_betas, max_betas in zip(self.min_moms, self.max_moms):
            cycle_min_mom = base_betas[0]
            cycle_max_mom = max_betas[0]
            base_height = (cycle_max_mom - cycle_min_mom) * scale_factor
            momentum = cycle_max_mom - base_height
            momentums.append((momentum, base_betas[1]))
        return momentums

    def _get_cycle_lr(self):  # :550-558
        scale_factor = self._get_scale_factor()
        lrs = []
        for cycle_min_lr, cycle_max_lr in zip(self.min_lrs, self.max_lrs):
            base_height = (cycle_max_lr - cycle_min_lr) * scale_factor
            lr = cycle_min_lr + base_height
            lrs.append(lr)
        return lrs

    def _get_decay_mom(self, decay_batch_iteration):  # :560-568
        if self.skip_mom_decay:
            return self.max_moms
        decay_interval = decay_batch_iteration / self.decay_step_size
        mom_decay_factor = (1 + self.decay_mom_rate * decay_interval)
        momentums = [(beta0 * mom_decay_factor, beta1) for beta0, beta1 in self.max_moms]
        return momentums

    def _get_decay_lr(self, decay_batch_iteration):  # :570-582
        if self.skip_lr_decay:
            return self.min_lrs
        decay_interval = decay_batch_iteration / self.decay_step_size
        lr_decay_factor = (1 + self.decay_lr_rate * decay_interval)
        lrs = [cycle_min_lr / lr_decay_factor for cycle_min_lr in self.min_lrs]
        return lrs

    def get_lr(self):  # :584-590
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_lr()
        return self._get_decay_lr(self.last_batch_iteration - self.total_size + 1)

    def get_mom(self):  # :592-601
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_mom()
        return self._get_decay_mom(self.last_batch_iteration - self.total_size + 1)

    def step(self, batch_iteration=None):  # :609-624
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())
        if self.cycle_momentum:
            momentums = self.get_mom()
            for param_group, momentum in zip(self.optimizer.param_groups, momentums):
                param_group['betas'] = momentum


class WarmupCosineLR:  # :774-870
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type='log', last_batch_iteration=-1):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [group['lr'] for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self):  # :826-845
        if self.last_batch_iteration < 0:
            return [0.0]
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == 'log':
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == 'linear':
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1. - self.warmup_min_ratio
            ratio = self.warmup_min_ratio + ratio * ratio_delta
            return ratio
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = self.total_num_steps - self.warmup_num_steps
        ratio_delta = 1. - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
        ratio = max(0.0, self.cos_min_ratio + ratio_delta * ratio)
        return ratio

    def step(self, last_batch_iteration=None):  # :847-851
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self):  # :853-858
        if self.last_batch_iteration < 0:
            return [0.0]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


def main():
    run = json.load(open(sys.argv[1]))
    kind, params, optimizer_lr = sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    optimizer = Optimizer(optimizer_lr, tuple(run["optimizer"]["betas"]))
    scheduler = {"LRRangeTest": LRRangeTest, "OneCycle": OneCycle, "WarmupCosineLR": WarmupCosineLR}[kind](
        optimizer, **params)  # engine.py _scheduler_from_config, :1113
    problems = []
    for step in run["steps"]:
        group = optimizer.param_groups[0]
        lr, betas = group["lr"], group["betas"]
        # zero2 takes log and cos with its own series (runtime/math.h): within
        # a few ulps of Python's libm, so a relative 1e-12 (an exact 0 stays 0).
        if abs(step["lr"] - lr) > 1e-12 * abs(lr) or (lr == 0) != (step["lr"] == 0):
            problems.append(f"step {step['step']}: lr {step['lr']!r} != DeepSpeed's {lr!r}")
        cycled = step.get("betas")
        if kind == "OneCycle" and scheduler.cycle_momentum:
            if cycled is None or any(abs(a - b) > 1e-15 for a, b in zip(cycled, betas)):
                problems.append(f"step {step['step']}: betas {cycled} != DeepSpeed's {list(betas)}")
        elif cycled is not None:
            problems.append(f"step {step['step']}: betas {cycled} recorded, and {kind} sets none")
        if not step["skipped"]:
            scheduler.step()  # engine.py _take_model_step, :2322: after an applied update only
    print("ok" if not problems else "; ".join(problems[:4]))


if __name__ == "__main__":
    main()
