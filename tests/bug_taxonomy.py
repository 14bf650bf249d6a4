"""tests/bug_taxonomy.py: the mistakes a ZeRO implementation is written with, as classes the checker
(tests/check_trace.py) names, and the planted-bug corpus (tests/checker_corpus/) generates from
(notes/12, "The bug taxonomy").

A class is one mistake, stated where it lives in the path of a gradient: the data and the sampler, the
loss's scaling, the accumulation over micro-steps, the reduction over ranks, clipping, each term of AdamW,
the optimizer's state and counters, the schedule, sharding and the all-gather, the tied weights, mixed
precision. `how` says how the checker can tell it from the others:

  replay    its hypothesis is replayed (tests/peers/adamw_replay.py, HYPOTHESES by the same id): from their
            parameters before the failing step, AdamW's state rebuilt from step 1, the step recomputed with the
            mistake; named only where it lands on theirs and no other fitting hypothesis does
  pattern   no replay can recompute it (it changes the forward pass, or what no trace records: a rank's own
            gradient), so a measured pattern points to it (tests/trace_diagnosis.py); named with the words
            "measured, not reproduced"
  scalar    it changes a recorded number alone (the loss, the norm, the rate) by a factor the checker tests
  power     below what a trace can see at these sizes in some settings: the PASS line's power says how
            large it would have to be to fail

Numpy-free and import-free: the corpus generator and the checker both read it.
"""

CATEGORIES = ("data", "loss", "accumulation", "reduction", "clipping", "adamw", "state", "schedule", "sharding",
              "tied", "precision")


def _c(id, category, how, summary):
    return {"id": id, "category": category, "how": how, "summary": summary}


CLASSES = [
    # --- data and the sampler: which rows a micro-batch reads
    _c("data.batch-of-next-step", "data", "pattern",
       "each step trains on the rows of the step after it (a sampler advanced before the first step)"),
    _c("data.rank-rows-duplicated", "data", "pattern",
       "every rank reads rank 0's rows (the rank offset left out of the sampler): the global batch is N copies"),
    _c("data.labels-all-positions", "data", "pattern",
       "the loss reads every position, not only the selected ones (labels' -100 ignored)"),
    # --- the loss's scaling
    _c("loss.mean-of-rank-means", "loss", "scalar",
       "the loss averaged per rank (Hugging Face's mean) and then over ranks, not over the global batch"),
    _c("loss.divided-by-A", "loss", "scalar",
       "the loss divided by the accumulation steps again (as Hugging Face's Trainer does): gradients 1/A"),
    _c("loss.summed-over-ranks", "loss", "scalar", "the loss reported summed over the ranks, not their total mean"),
    _c("loss.summed-cross-entropy", "loss", "scalar", "the summed cross-entropy, not its mean"),
    _c("loss.mean-of-micro-batch-means", "loss", "scalar",
       "the loss averaged per micro-batch and then over the micro-batches, not over the global batch"),
    _c("loss.summed-over-micro-steps", "loss", "scalar", "the loss reported summed over the micro-steps: A x"),
    _c("loss.divided-by-N", "loss", "scalar", "each rank's part of the loss divided by N again: 1/N x"),
    _c("loss.forward-differs", "loss", "pattern",
       "the forward pass differs (the activation, LayerNorm's eps, the batch's rows): the loss from the same "
       "weights and batch is another"),
    # --- accumulation over micro-steps
    _c("accumulation.overwrites", "accumulation", "pattern",
       "each micro-step's gradient replaces the buffer instead of adding to it: only the last micro-step counts"),
    _c("accumulation.not-zeroed", "accumulation", "pattern",
       "the gradient buffer not zeroed after the update: this step's gradient plus the last one's"),
    _c("accumulation.summed-not-averaged", "accumulation", "pattern",
       "the micro-steps' gradients summed where the loss already averages them: A x the gradient"),
    # --- the reduction over ranks
    _c("reduction.summed", "reduction", "pattern", "the gradients summed over the ranks, not averaged: N x"),
    _c("reduction.averaged-twice", "reduction", "pattern", "the gradients averaged twice: 1/N x"),
    _c("reduction.bucket-skipped", "reduction", "pattern", "one bucket's reduce-scatter never ran: its gradient 0"),
    _c("reduction.bucket-local", "reduction", "pattern",
       "one bucket not reduced: each rank keeps its own micro-batches' gradient there"),
    _c("reduction.stale", "reduction", "pattern",
       "a region's gradient is the last step's: not recomputed or not reduced again"),
    _c("reduction.rank-shard-zero", "reduction", "pattern", "one rank's shard of the gradient never received: 0"),
    # --- clipping
    _c("clipping.none", "clipping", "replay", "no gradient clipping where the trace clips"),
    _c("clipping.local-norm", "clipping", "replay", "each rank clips its shard by its own shard's norm"),
    _c("clipping.per-group", "clipping", "replay",
       "each parameter group (decayed, not decayed) clipped by its own norm, not the global one"),
    _c("clipping.per-tensor", "clipping", "replay", "each tensor clipped by its own norm"),
    _c("clipping.threshold-scaled", "clipping", "replay",
       "clipping to another threshold than optimizer.clip (a config key read wrongly): the coefficient scaled"),
    _c("clipping.norm-before-average", "clipping", "scalar",
       "the norm taken before the gradients were averaged: N x the norm (and the clip coefficient from it)"),
    _c("clipping.norm-own-shard", "clipping", "scalar",
       "the norm of the rank's own shard alone, the squares not summed over the ranks"),
    _c("clipping.norm-averaged-twice", "clipping", "scalar",
       "the norm taken of a gradient divided by N twice: 1/N x the norm (and the clip coefficient from it)"),
    # --- each term of AdamW
    _c("adamw.l2-decay", "adamw", "replay", "wd p added to the gradient Adam normalises (Adam's L2), not decoupled"),
    _c("adamw.no-decay", "adamw", "replay", "no weight decay at all"),
    _c("adamw.decay-everything", "adamw", "replay", "weight decay on biases and LayerNorm too"),
    _c("adamw.no-decay-on-embeddings", "adamw", "replay", "the embeddings put in the group without decay"),
    _c("adamw.decay-without-lr", "adamw", "replay", "p (1 - wd), not p (1 - lr wd)"),
    _c("adamw.decay-scaled", "adamw", "replay", "weight decay by another factor than optimizer.weight_decay"),
    _c("adamw.eps-inside", "adamw", "replay", "sqrt(v_hat + eps), not sqrt(v_hat) + eps"),
    _c("adamw.eps-inside-uncorrected", "adamw", "replay", "sqrt(v + eps) / sqrt(1 - beta2^t)"),
    _c("adamw.eps-other", "adamw", "replay", "another eps than optimizer.eps (1e-6 for 1e-8)"),
    _c("adamw.no-bias-correction", "adamw", "replay", "neither m nor v bias-corrected"),
    _c("adamw.no-bias-correction-m", "adamw", "replay", "m not bias-corrected"),
    _c("adamw.no-bias-correction-v", "adamw", "replay", "v not bias-corrected"),
    _c("adamw.betas-swapped", "adamw", "replay", "beta1 used for v and beta2 for m"),
    _c("adamw.momentum-undamped", "adamw", "replay", "m = beta1 m + g, without the (1 - beta1) on g"),
    _c("adamw.v-of-abs", "adamw", "replay", "v averages |g|, not g^2"),
    # --- the optimizer's state and counters
    _c("state.reset-each-step", "state", "replay", "m and v zeroed before every step (an optimizer made anew)"),
    _c("state.counter-ahead", "state", "replay", "the bias corrections count t + 1 (a counter one ahead)"),
    _c("state.counter-micro-steps", "state", "replay",
       "the bias corrections count micro-steps (t A), not updates"),
    _c("state.update-not-applied", "state", "replay",
       "the update never reached the weights (the optimizer stepped a copy): the parameters do not move"),
    _c("state.group-not-updated", "state", "pattern",
       "some tensors left out of the update (a parameter group missing from the optimizer): they do not move"),
    # --- the schedule
    _c("schedule.lr-of-step-before", "schedule", "replay", "step s updates with the rate of step s - 1"),
    _c("schedule.lr-of-step-after", "schedule", "replay", "step s updates with the rate of step s + 1"),
    _c("schedule.lr-scaled", "schedule", "replay",
       "every update's rate a constant factor off the recorded one (lr x N, the linear scaling rule)"),
    _c("schedule.warmup-from-zero", "schedule", "replay",
       "the warmup counted from 0: the first update at rate 0, then every rate one step late"),
    _c("schedule.fixed-betas", "schedule", "replay",
       "the optimizer's betas in every update where the scheduler sets them per update (DeepSpeed's OneCycle)"),
    # --- sharding and the all-gather
    _c("sharding.stale-all-gather", "sharding", "pattern", "the all-gather ran before the update"),
    _c("sharding.offset-off-by-one", "sharding", "pattern", "a rank's shard offset by one rank"),
    _c("sharding.rank-skips-all-gather", "sharding", "pattern", "one rank's shards left out of an all-gather"),
    # --- the tied weights
    _c("tied.decoder-untied", "tied", "pattern",
       "the decoder's gradient not added into the word embeddings' (a weight tied in the forward only)"),
    # --- mixed precision
    _c("precision.no-master", "precision", "pattern",
       "the 16-bit parameters stepped directly: no fp32 master, small updates rounded away"),
    _c("precision.loss-scale-in-norm", "precision", "scalar",
       "fp16: the norm (and the clip) taken before the loss scale was divided out"),
    _c("precision.gradient-rounded-twice", "precision", "power",
       "the gradient rounded to 16 bits before and after the reduction (a legitimate-looking double rounding)"),
]

BY_ID = {c["id"]: c for c in CLASSES}
assert len(BY_ID) == len(CLASSES), "a class id given twice"
