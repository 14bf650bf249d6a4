// runtime/lab_checks.cpp — a lab build's checks of a student's seams
// (runtime/lab_build.h says when they run): shard_begin against the slices the
// bucket exchange gives each rank, and update_region's runs against the
// buffers they index, for every rank, so that every rank stops together with
// the message. Compiled in every build; only a lab build calls them.
#include "runtime/lab_build.h"

namespace z2 {

// A student's shard_begin (the shards lab) is checked here, on every rank
// for every rank, so that a wrong one stops all ranks with this message
// instead of one rank tripping over its shard inside a collective.
void check_lab_shards(const std::vector<BucketInfo>& buckets, int world_size) {
  for (const BucketInfo& b : buckets)
    for (int r = 0; r < world_size; ++r)
      if (shard_begin(b, r) != b.offset + (size_t)r * b.shard_length)
        usage_error(
            "lab build: shard_begin(bucket at %zu, rank %d) = %zu, but the bucket exchange gives rank %d the "
            "bucket's slice %d, which begins at %zu",
            b.offset, r, shard_begin(b, r), r, r, b.offset + (size_t)r * b.shard_length);
}

// A student's update_region (the own-shards lab), likewise for every rank:
// each run must lie inside the buffer it indexes, at this stage's sizes
// (engine_buffers), or AdamW would write past it.
void check_lab_regions(const std::vector<BucketInfo>& buckets, const EngineBuffers& sizes, int stage, int world_size) {
  const size_t padded = sizes.psi_padded, shard = padded / (size_t)world_size;
  const size_t gradients = stage == 2 ? shard : padded, state = stage == 0 ? padded : shard;
  for (size_t b = 0; b < buckets.size(); ++b)
    for (int r = 0; r < world_size; ++r) {
      const UpdateRegion region = update_region(buckets[b], stage, r);
      const struct {
        const char* buffer;
        size_t begin, size;
      } runs[] = {{"parameter", region.parameter, padded},
                  {"gradient", region.gradient, gradients},
                  {"state", region.state, state}};
      for (const auto& run : runs) {
        if (run.begin <= run.size && region.length <= run.size - run.begin) continue;  // (no wrap-around)
        std::string why;
        if (stage > 0 && region.length == buckets[b].padded_length)
          why = ": in this stage a rank updates its own shard only (shard_length elements), not the whole bucket";
        else if (stage > 0 && run.begin == shard_begin(buckets[b], r))
          why = std::string(": the ") + run.buffer +
                " buffer holds the own shards one after another, each bucket's at its shard_offset; shard_begin is "
                "where a shard lies in the full parameter buffer";
        usage_error(
            "lab build: update_region(bucket %zu, stage %d, rank %d) puts %zu elements at %s %zu, past the "
            "%s buffer's %zu%s",
            b, stage, r, region.length, run.buffer, run.begin, run.buffer, run.size, why.c_str());
      }
    }
}

}  // namespace z2
