#!/usr/bin/python3
"""notes/gradient_path.py — how many lines a reader reads to follow one
gradient through zero2 (notes/00, "Following one gradient"): from where
backward writes it, through its bucket's reduce-scatter and the step, to
the all-gather of the updated shard, in stage 2 over MPI (the default run).

Each entry is a definition in zero2.cu or zero2.h, in the order the
gradient meets it; a definition counts from the comment above it to its
closing brace. Prints a Markdown table (file, what, lines, the lines
themselves) and the total. Run from the repository's top folder:

    python3 notes/gradient_path.py
"""
import re
import sys

# (file, the text its definition line starts with, what it is)
PATH = [
    ("zero2.cu", "void* Engine::gradient_storage(", "where backward writes a gradient"),
    ("zero2.cu", "Z2_LAB_SEAM void* stage2_gradient_output(", "stage 2: the bucket's slot (seam)"),
    ("zero2.cu", "struct Engine::RankState::SlotGradients : GradientShards {", "the slots lent to the seams"),
    ("zero2.cu", "int BucketExchange::acquire(", "a slot for the bucket: at most staging_slots (2) in flight"),
    ("zero2.cu", "void* BucketExchange::open_bucket_buffer(", "the slot zeroed for backward"),
    ("zero2.cu", "void Engine::gradient_ready(", "the gradient handed over"),
    ("zero2.cu", "Z2_LAB_SEAM void stage2_gradient_ready(", "the bucket complete: reduce-scatter (seam)"),
    ("zero2.cu", "void Engine::RankState::SlotGradients::reduce_scatter(", "the own shard kept"),
    ("zero2.cu", "AccumulateInto Engine::RankState::accumulate_into(", "where the sum goes"),
    ("zero2.cu", "void BucketExchange::start_reduce_scatter(", "a transfer in the slot"),
    ("zero2.cu", "std::unique_ptr<Collective> BucketExchange::Parts::reduce_scatter_collective(", "which collective carries it"),
    ("zero2.cu", "struct MpiReduceScatter : Collective {", "the slices over MPI, step by step"),
    ("zero2.cu", "void ShardSums::sum_and_accumulate_as(", "the receiver's canonical-tree sum"),
    ("zero2.h", "Z2_HD inline float canonical_tree_sum(", "the canonical tree"),
    ("zero2.h", "Z2_HD inline void accumulate_micro_step(", "gradient accumulation"),
    ("zero2.cu", "void Engine::end_micro_step(", "every bucket reduced"),
    ("zero2.cu", "StepReport Engine::step() {", "the step, call by call"),
    ("zero2.cu", "StepReport Engine::RankState::open_step() {", "the learning rate of this update"),
    ("zero2.cu", "std::vector<float> Engine::RankState::local_chunk_sums(", "the own shard's squares"),
    ("zero2.cu", "void Engine::RankState::chunk_squares_as(", "a norm chunk's squares"),
    ("zero2.h", "Z2_HD inline float perfect_tree_sum(", "the tree inside a chunk"),
    ("zero2.cu", "bool Engine::RankState::overflow_skips_step(", "fp16: an overflow skips the step"),
    ("zero2.cu", "float Engine::RankState::global_norm(", "the global norm"),
    ("zero2.cu", "float Engine::RankState::global_squared_norm(", "every rank's chunks, in canonical order"),
    ("zero2.cu", "float Engine::RankState::clip_coefficient(", "clipping"),
    ("zero2.cu", "void Engine::RankState::apply_update(", "AdamW, then the all-gather"),
    ("zero2.cu", "AdamWConstants Engine::RankState::adamw_constants(", "AdamW's scalars"),
    ("zero2.cu", "struct Engine::RankState::StepOverShards : OwnShards {", "what the own-shards seam is lent"),
    ("zero2.cu", "Z2_LAB_SEAM void update_and_gather(", "the stage's step (seam)"),
    ("zero2.cu", "Z2_LAB_SEAM UpdateRegion update_region(", "the own shard in each buffer (seam)"),
    ("zero2.cu", "Z2_LAB_SEAM size_t shard_begin(", "where a rank's shard begins (seam)"),
    ("zero2.cu", "void Engine::RankState::adamw_as(", "AdamW on the own shard"),
    ("zero2.h", "Z2_HD inline void adamw_update(", "AdamW, element by element"),
    ("zero2.cu", "void Engine::RankState::gather_parameters(", "the updated shard to every rank"),
    ("zero2.cu", "void BucketExchange::start_all_gather(", "a transfer in the slot"),
    ("zero2.cu", "std::unique_ptr<Collective> BucketExchange::Parts::all_gather_collective(", "which collective carries it"),
    ("zero2.cu", "struct MpiAllGather : MpiCollective {", "MPI's all-gather"),
    ("zero2.cu", "void Engine::RankState::wait_for_all_gathers() {", "forward may read the parameters"),
]


def definition(lines, start_text):
    """(first, last) 1-based lines of the definition starting with start_text,
    its leading comment (and a template line) included."""
    starts = [k for k, line in enumerate(lines) if line.startswith(start_text)]
    if len(starts) != 1:
        sys.exit(f"gradient_path.py: '{start_text}' starts {len(starts)} lines (want exactly 1)")
    first = last = starts[0]
    while first > 0 and (lines[first - 1].startswith("//") or lines[first - 1].startswith("template")):
        first -= 1
    depth, opened = 0, False
    for k in range(last, len(lines)):
        depth += lines[k].count("{") - lines[k].count("}")
        opened = opened or "{" in lines[k]
        if opened and depth <= 0:
            last = k
            break
    return first + 1, last + 1


def main():
    files = {name: open(name).read().split("\n") for name in ("zero2.cu", "zero2.h")}
    print("| | file | what | lines | where |")
    print("|---|---|---|---|---|")
    total = 0
    for k, (name, start, what) in enumerate(PATH, 1):
        first, last = definition(files[name], start)
        count = last - first + 1
        total += count
        shown = re.sub(r"\s*[({]\s*$", "", start).replace("Z2_LAB_SEAM ", "").replace("Z2_HD inline ", "")
        print(f"| {k} | {name} | {what}: `{shown}` | {count} | {first}-{last} |")
    print(f"\n{len(PATH)} definitions, {total} lines in all (zero2.cu has {len(files['zero2.cu'])} lines, "
          f"zero2.h {len(files['zero2.h'])}).")


if __name__ == "__main__":
    main()
