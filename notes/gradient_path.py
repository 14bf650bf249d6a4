#!/usr/bin/python3
"""notes/gradient_path.py — how many lines a reader reads to follow one
gradient through zero2 (notes/00, "Following one gradient"): from where it
lives and where backward writes it, through its bucket's reduce-scatter
(the transfer that carries it included) and the step, to the all-gather of
the updated shard, in stage 2 over MPI (the default run: fp32, the
deterministic collectives, no offload).

Each entry is a definition, in the order the reader meets it; a definition
counts from the comment above it to its closing brace, and once (a later
call to one already read is not read again). Left out, and named where
they are called: the compute backend's calls (Compute: copies, events,
loops, like MPI's own calls), the refusals and the adapters the lab seams
are lent (runtime/lab_adapters.h: the course's checks, not ZeRO's), the
hooks of ZeRO-Offload's step (runtime/offload.h), the loss (beside the
gradient), fp16's overflow check and loss scale and the norm's rescaling
(not taken in fp32),
and the ledger's accounting.

Prints a Markdown table (file, what, lines, where; "back" marks a
definition that lies before the reader's last position in its file), then
the totals: definitions, lines, files, backward jumps and file changes.
Run from the repository's top folder:

    python3 notes/gradient_path.py
"""
import re
import sys

CU, H, T = "zero2.cu", "zero2.h", "runtime/transfers.h"
# (file, the text its definition line starts with, what it is)
PATH = [
    (CU, "Z2_LAB_SEAM size_t shard_begin(", "where a rank's shard begins (seam)"),
    (CU, "Z2_LAB_SEAM UpdateRegion update_region(", "the own shard in each buffer (seam)"),
    (CU, "void for_precision(Precision precision, Call call) {", "a kernel for a precision's type"),
    (CU, "  char* at(DeviceArray<char>& buffer, size_t index)", "a rank's buffers: an element's address"),
    (CU, "  UpdateRegion region(int b) const", "the rank's update region of a bucket"),
    (CU, "  void* region_param(int b)", "its parameters"),
    (CU, "struct Engine::RankState::StepHome {", "where the step finds its buffers and runs"),
    (CU, "void* Engine::gradient_storage(", "where backward writes a gradient"),
    (CU, "Z2_LAB_SEAM void* stage2_gradient_output(", "stage 2: the bucket's slot (seam)"),
    (CU, "void Engine::RankState::take_slot(", "a slot taken, zeroed"),
    (CU, "int BucketExchange::acquire(", "a slot for the bucket: at most staging_slots (2) in flight"),
    (T, "struct Slot {", "a slot's buffers"),
    (T, "struct WireType {", "the element type on the wire"),
    (T, "Z2_HD inline size_t received_index(", "which received slice is rank j's"),
    (T, "struct Collective {", "one collective's steps"),
    (T, "struct Transfer {", "a transfer: a bucket's collectives in a slot"),
    (T, "struct BucketExchange::Parts {", "the exchange: slots, transfers in flight, sums"),
    (T, "inline int BucketExchange::Parts::free_slot(", "a free slot"),
    (T, "inline void BucketExchange::Parts::finish(", "the oldest transfer finished"),
    (T, "inline void BucketExchange::Parts::retire_finished(", "its slot back"),
    (CU, "void* BucketExchange::open_bucket_buffer(", "the slot zeroed for backward"),
    (CU, "void Engine::gradient_ready(", "the gradient handed over"),
    (CU, "void Engine::RankState::gradient_ready(", "counted in its bucket"),
    (CU, "Z2_LAB_SEAM void stage2_gradient_ready(", "the bucket complete: reduce-scatter (seam)"),
    (CU, "void Engine::RankState::reduce_slot(", "the bucket's reduce-scatter from its slot"),
    (CU, "int BucketExchange::slot_of(", "the bucket's slot"),
    (CU, "AccumulateInto Engine::RankState::accumulate_into(", "where the sum goes"),
    (CU, "void BucketExchange::start_reduce_scatter(", "a transfer in the slot"),
    (T, "inline Transfer* BucketExchange::Parts::start(", "the transfer started, after what the compute stream wrote"),
    (T, "struct MpiCollective : Collective {", "an MPI collective's steps"),
    (CU, "struct MpiReduceScatter : MpiCollective {", "the slices over MPI, as an MPI collective"),
    (CU, "std::unique_ptr<Collective> BucketExchange::Parts::reduce_scatter_collective(", "which collective carries it"),
    (CU, "static void for_exchange_types(", "the kernel for the exchange's types"),
    (CU, "static void sum_and_accumulate_as(", "the receiver's canonical-tree sum, a kernel"),
    (CU, "void BucketExchange::Parts::sum_and_accumulate(", "the receiver's sum, in the exchange's types"),
    (H, "Z2_HD inline float canonical_tree_sum(", "the canonical tree"),
    (H, "Z2_HD inline float sum_over_ranks(", "the tree over the ranks' slices"),
    (H, "Z2_HD inline void accumulate_micro_step(", "gradient accumulation"),
    (CU, "void Engine::progress(", "between layers"),
    (CU, "void BucketExchange::progress(", "every transfer moved on as far as it goes"),
    (CU, "void Engine::end_micro_step(", "the micro-step's end"),
    (CU, "void Engine::RankState::end_micro_step(", "every bucket reduced"),
    (CU, "void BucketExchange::finish_all(", "every transfer finished"),
    (CU, "void Engine::RankState::reduce_buckets_left(", "none left (stage 2)"),
    (CU, "StepReport Engine::step() {", "the step, call by call"),
    (CU, "StepReport Engine::RankState::open_step() {", "the learning rate of this update"),
    (CU, "std::vector<float> Engine::RankState::local_chunk_sums(", "the own shard's squares"),
    (CU, "void Engine::RankState::chunk_squares_as(", "a norm chunk's squares"),
    (H, "Z2_HD inline float perfect_tree_sum(", "the tree inside a chunk"),
    (CU, "float Engine::RankState::global_norm(", "the global norm"),
    (CU, "float Engine::RankState::global_squared_norm(", "every rank's chunks, in canonical order"),
    (CU, "Z2_LAB_SEAM float tree_sum(", "the canonical tree over them (seam)"),
    (CU, "float Engine::RankState::clip_coefficient(", "clipping"),
    (CU, "void Engine::RankState::apply_update(", "AdamW, then the all-gather"),
    (CU, "AdamWConstants Engine::RankState::adamw_constants(", "AdamW's scalars"),
    (CU, "static void gather_each_when_updated(", "each bucket updated, then all-gathered"),
    (CU, "void Engine::RankState::adamw(", "AdamW on a bucket"),
    (CU, "void Engine::RankState::adamw_as(", "AdamW on the own shard"),
    (H, "Z2_HD inline float adamw_update(", "AdamW, element by element"),
    (H, "struct AdamWByChunk {", "AdamW's loop body over it, a row per norm chunk"),
    (CU, "void Engine::RankState::gather_parameters(", "the updated shard to every rank"),
    (CU, "struct MpiAllGather : MpiCollective {", "MPI's all-gather"),
    (CU, "std::unique_ptr<Collective> BucketExchange::Parts::all_gather_collective(", "which collective carries it"),
    (CU, "void BucketExchange::start_all_gather(", "a transfer in the slot"),
    (CU, "void Engine::RankState::wait_for_all_gathers() {", "forward may read the parameters"),
]


def definition(lines, start_text):
    """(first, last) 1-based lines of the definition starting with start_text,
    its leading comment (and a template line) included."""
    starts = [k for k, line in enumerate(lines) if line.startswith(start_text)]
    if len(starts) != 1:
        sys.exit(f"gradient_path.py: '{start_text}' starts {len(starts)} lines (want exactly 1)")
    first = last = starts[0]
    while first > 0 and lines[first - 1].lstrip().startswith(("//", "template")):
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
    files = {name: open(name).read().split("\n") for name in sorted({entry[0] for entry in PATH})}
    print("| | file | what | lines | where |")
    print("|---|---|---|---|---|")
    total = jumps = changes = 0
    position = {}  # file -> the last line the reader read there
    previous = None
    for k, (name, start, what) in enumerate(PATH, 1):
        first, last = definition(files[name], start)
        count = last - first + 1
        total += count
        back = first < position.get(name, 0)
        jumps += back
        changes += previous is not None and name != previous
        position[name], previous = max(position.get(name, 0), last), name
        shown = re.sub(r"\s*[({]\s*$", "", start.strip())
        shown = shown.replace("Z2_LAB_SEAM ", "").replace("Z2_HD inline ", "").replace("inline ", "")
        print(f"| {k} | {name} | {what}: `{shown}` | {count} | {first}-{last}{' back' if back else ''} |")
    sizes = ", ".join(f"{name} {len(text)}" for name, text in files.items())
    print(f"\n{len(PATH)} definitions, {total} lines in {len(files)} files ({sizes} lines long); "
          f"{jumps} backward jumps, {changes} file changes.")


if __name__ == "__main__":
    main()
