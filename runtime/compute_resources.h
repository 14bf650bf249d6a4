// runtime/compute_resources.h — what a Compute keeps behind its pointer
// (private to runtime/compute.cpp, runtime/allocators.cpp and runtime/gemm.cu):
// every live allocation with its size and kind, the one block of the arena
// and naive allocators, the caching allocator's segments and pools, and the
// cpu 16-bit gemm's scratch.
#pragma once

#include <map>
#include <set>
#include <unordered_map>

#include "zero2.h"

namespace z2 {

// Every live allocation with its size and kind: release() needs both to keep
// the per-kind counters exact, and ~Compute frees what is left. With arena
// or naive, also the block and where its free memory is.
struct Compute::Resources {
  std::unordered_map<void*, std::pair<size_t, MemoryKind>> allocations;
  // Page-locked host buffers: their bytes, and which counter holds them.
  struct PinnedBuffer {
    size_t bytes = 0;
    enum class Use { comm_staging, activation_offload, offloaded_state } use = Use::comm_staging;
    MemoryKind kind = MemoryKind::count;  // offloaded_state: which model state (allocate_host)
  };
  std::unordered_map<void*, PinnedBuffer> pinned;
  char* block = nullptr;  // the one reserved block (arena, naive)
  size_t capacity = 0;    // its size in bytes
  // naive: the free pieces, offset -> size, ordered so neighbours coalesce;
  // `end` is the highest byte any buffer has used (the caching allocator's
  // reserved segments end there).
  std::map<size_t, size_t> free_pieces;
  size_t end = 0;
  // arena: its books (zero2.h, ArenaBooks).
  ArenaBooks arena;
  // caching: segments (each its own device allocation), every block of every
  // segment by address, and the free blocks of each pool by (size, address),
  // so the first one not smaller than a request is the best fit.
  struct Segment {
    char* base;
    size_t bytes;
    bool small;  // serves the small pool (a 2 MiB segment) or the large one
  };
  struct CachedBlock {
    size_t bytes;
    int segment;
    bool free;
  };
  std::map<int, Segment> segments;
  int next_segment = 0;
  size_t segment_bytes = 0;  // all segments: PyTorch's "reserved"
  std::map<char*, CachedBlock> cached_blocks;
  std::set<std::pair<size_t, char*>> small_pool, large_pool;
  std::set<std::pair<size_t, char*>>& pool_of(int segment) { return segments[segment].small ? small_pool : large_pool; }
  size_t offset_of(const void* pointer) const { return (size_t)((const char*)pointer - block); }
  // cpu 16-bit gemm: A, B and C widened to fp32 (host scratch, reused).
  std::vector<float> gemm_a, gemm_b, gemm_c;
};

}  // namespace z2
