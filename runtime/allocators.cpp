// runtime/allocators.cpp — where device memory comes from (ZeRO-R's M_D,
// paper section 6.3; notes/05): the Compute's allocators, the ledger's
// counters that every allocation passes through, and the memory trace. The
// arena's books themselves (arena_allocate, arena_push, ...) are zero2.cu's,
// a lab seam: this file asks them for offsets and turns offsets into
// pointers. Host code: on cuda the block and the segments are cudaMalloc's.
#include "runtime/compute_resources.h"
#include "runtime/simulated_device.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#if defined(Z2_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace z2 {

// The paper (section 3.2) observed out-of-memory errors with over 30% of the
// memory still free: long-lived tensors (activation checkpoints, gradients)
// are allocated between short-lived ones, and when the short-lived ones go
// the free memory is left in pieces too small for the next large request.
// Its remedy, M_D (section 6.3), pre-allocates contiguous buffers for the long-lived
// tensors. We model both sides over one block of the same capacity:
//
//   naive  every request searches a best-fit free list (the caching allocator)
//   arena  long-lived buffers from the bottom, temporaries on a stack from the
//          top: the free memory is the one gap between them, never in pieces.
//
// reserved = the block's used part at its peak: the highest byte a buffer has
// touched for naive (a caching allocator's segments would end there), the
// bottom plus the stack for the arena, the live bytes for direct.

// Every buffer in the block starts on a 256-byte boundary, as cudaMalloc's
// do, so cuBLAS sees the same alignment (and picks the same kernels) in every
// allocator mode.
size_t block_round(size_t bytes) { return (bytes + 255) / 256 * 256; }

void Compute::use_allocator(Allocator allocator, size_t capacity) {
  if (counters_.device_mallocs != 0 || allocator_ != Allocator::direct)
    usage_error("use_allocator() must come before the first allocation, once");
  allocator_ = allocator;
  if (allocator == Allocator::direct) {  // the limit only counts: every buffer is its own cudaMalloc
    resources_->capacity = capacity;
    return;
  }
  if (capacity < 256) usage_error("--device-memory-limit %zu: the block needs at least 256 bytes", capacity);
  capacity = capacity / 256 * 256;
  resources_->capacity = capacity;
  // caching reserves nothing up front: it asks the device for segments as it
  // goes (cudaMalloc), and `capacity` is how much the device lets it have.
  if (allocator == Allocator::caching) return;
  if (device_ != Device::cuda) {
    // Address space only: the kernel gives pages when they are first
    // touched, so an unused capacity costs nothing on a CPU run.
    void* block = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (block == MAP_FAILED)
      usage_error("cannot reserve %s bytes of address space for the memory block", with_commas(capacity).c_str());
    resources_->block = (char*)block;
    if (sim_) sim_->adopt_memory(block, capacity);  // closed to the host, as a GPU's memory is
  } else {
#if defined(Z2_HAVE_CUDA)
    void* block = nullptr;
    cudaError_t status = cudaMalloc(&block, capacity);
    if (status != cudaSuccess) {
      cudaGetLastError();
      usage_error("cannot reserve a block of %s bytes on GPU %d (%s): lower --device-memory-limit",
                  with_commas(capacity).c_str(), device_index_, cudaGetErrorString(status));
    }
    resources_->block = (char*)block;
#endif
  }
  counters_.device_mallocs += 1;
  resources_->free_pieces[0] = capacity;
  resources_->arena = ArenaBooks{capacity, 0, capacity, {}};
}

size_t Compute::capacity() const { return resources_->capacity; }

void Compute::free_space(size_t* total, size_t* pieces, size_t* largest) const {
  *total = *pieces = *largest = 0;
  if (allocator_ == Allocator::direct && resources_->capacity > 0) {  // what the limit leaves: the driver's to place
    *total = *largest = resources_->capacity - counters_.total_current;
    *pieces = *total > 0 ? 1 : 0;
  } else if (allocator_ == Allocator::arena) {
    *total = *largest = resources_->arena.top - resources_->arena.bottom;
    *pieces = *total > 0 ? 1 : 0;
  } else if (allocator_ == Allocator::naive) {
    for (auto& piece : resources_->free_pieces) {
      *total += piece.second;
      *pieces += 1;
      *largest = std::max(*largest, piece.second);
    }
  } else if (allocator_ == Allocator::caching) {
    // What the device has not given out yet is one piece (the driver pages
    // it); the rest is free blocks cached inside segments.
    const size_t unreserved = resources_->capacity - resources_->segment_bytes;
    *total = *largest = unreserved;
    *pieces = unreserved > 0 ? 1 : 0;
    for (auto* pool : {&resources_->small_pool, &resources_->large_pool})
      for (auto& block : *pool) {
        *total += block.first;
        *pieces += 1;
        *largest = std::max(*largest, block.first);
      }
  }
}

void Compute::out_of_memory(size_t bytes, MemoryKind kind, size_t segment) const {
  size_t total = 0, pieces = 0, largest = 0;
  free_space(&total, &pieces, &largest);
  // caching: why none of that free memory serves the request.
  std::string why;
  if (allocator_ == Allocator::caching)
    why = ", but none can hold it: no cached block of the " +
          std::string(caching_round_size(bytes) <= (1 << 20) ? "small" : "large") +
          " pool holds the request rounded to " + with_commas(caching_round_size(bytes)) + " bytes, and a new " +
          with_commas(segment) + "-byte segment does not fit in the " +
          with_commas(resources_->capacity - resources_->segment_bytes) + " bytes of the limit not yet in segments (" +
          with_commas(resources_->segment_bytes) + " bytes in " + std::to_string(resources_->segments.size()) +
          " segment(s); the wholly free cached segments were released and the request retried once)";
  const std::string message = format_text(
      "out of device memory in the %s-byte %s (--alloc %s): %s bytes of %s asked for; %s bytes free in "
      "%zu piece(s), the largest %s bytes%s; %s bytes held. Raise --device-memory-limit (train_bert_mini --plan "
      "gives what the arena needs)%s",
      with_commas(resources_->capacity).c_str(),
      allocator_ == Allocator::arena || allocator_ == Allocator::naive ? "block" : "device limit",
      to_string(allocator_), with_commas(bytes).c_str(), to_string(kind), with_commas(total).c_str(), pieces,
      with_commas(largest).c_str(), why.c_str(), with_commas(counters_.total_current).c_str(),
      allocator_ == Allocator::naive || allocator_ == Allocator::caching
          ? ", or use --alloc arena, whose free memory never breaks into pieces"
          : "");
  throw OutOfMemory(message);
}

void* Compute::device_malloc(size_t bytes) {
  void* pointer = nullptr;
  if (sim_) {
    pointer = sim_->map_memory(bytes);  // whole pages, closed to the host (runtime/simulated_device.h)
  } else if (device_ != Device::cuda) {
    // 256-byte alignment, as cudaMalloc gives: vector loads and sgemm like
    // aligned rows. aligned_alloc wants a multiple of the alignment.
    pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    // Running out may happen on one rank only: take every rank down rather
    // than leave the others waiting in their next collective.
    if (!pointer) abort_all_ranks("memory", "out of host memory", "allocate", __FILE__, __LINE__);
  } else {
#if defined(Z2_HAVE_CUDA)
    Z2_CUDA_CHECK(cudaMalloc(&pointer, bytes));
#endif
  }
  counters_.device_mallocs += 1;
  return pointer;
}

void Compute::device_free(void* pointer) {
  if (sim_) {
    sim_->unmap_memory(pointer);
  } else if (device_ != Device::cuda) {
    std::free(pointer);
  } else {
#if defined(Z2_HAVE_CUDA)
    Z2_CUDA_CHECK(cudaFree(pointer));
#endif
  }
}

// --- caching: a model of PyTorch's CUDA caching allocator ----------------------
//
// What most users run (c10/cuda/CUDACachingAllocator.cpp), with its default
// settings (no max_split_size, no expandable segments, one stream):
//   - a request is rounded up to a multiple of kMinBlockSize = 512 bytes;
//   - requests up to kSmallSize = 1 MiB come from the small pool, larger ones
//     from the large pool; each pool is a set of free blocks, and a request
//     takes the smallest one that holds it (the lowest address on a tie);
//   - when none does, a new segment comes from the device (cudaMalloc):
//     kSmallBuffer = 2 MiB for a small request, kLargeBuffer = 20 MiB for one
//     below kMinLargeAlloc = 10 MiB, else the request rounded up to
//     kRoundLarge = 2 MiB;
//   - a block is split when what is left is worth keeping: >= 512 bytes in
//     the small pool, > 1 MiB in the large one (else the request keeps the
//     whole block, the rest unusable until it is freed);
//   - a freed block merges with its free neighbours in the same segment, never
//     across segments, and segments stay cached (never given back);
//   - when the device refuses a segment, every cached segment that is wholly
//     free is released and the request retried once; then out of memory.
// The device here is --device-memory-limit bytes: a segment is refused when
// the segments would exceed it. Unlike arena and naive, no block is reserved.
static const size_t kMinBlockSize = 512, kSmallSize = 1 << 20, kSmallBuffer = 2 << 20, kLargeBuffer = 20 << 20,
                    kMinLargeAlloc = 10 << 20, kRoundLarge = 2 << 20;

size_t caching_round_size(size_t bytes) {
  return bytes < kMinBlockSize ? kMinBlockSize : (bytes + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}
size_t caching_segment_size(size_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

void* Compute::caching_take(size_t bytes, MemoryKind kind) {
  Resources& held = *resources_;  // what this Compute holds: allocations, the block, the pools
  const size_t size = caching_round_size(bytes);
  const bool small = size <= kSmallSize;
  auto& pool = small ? held.small_pool : held.large_pool;
  auto found = pool.lower_bound({size, nullptr});
  if (found == pool.end()) {
    const size_t segment = caching_segment_size(size);
    if (held.segment_bytes + segment > held.capacity) {
      // The device said no: release the segments that are wholly free (one
      // free block spanning the segment), then try once more.
      for (auto it = held.segments.begin(); it != held.segments.end();) {
        auto block = held.cached_blocks.find(it->second.base);
        if (block->second.free && block->second.bytes == it->second.bytes) {
          (it->second.small ? held.small_pool : held.large_pool).erase({block->second.bytes, block->first});
          held.cached_blocks.erase(block);
          held.segment_bytes -= it->second.bytes;
          device_free(it->second.base);
          it = held.segments.erase(it);
        } else {
          ++it;
        }
      }
      if (held.segment_bytes + segment > held.capacity) out_of_memory(bytes, kind, segment);
    }
    char* base = (char*)device_malloc(segment);
    const int id = held.next_segment++;
    held.segments[id] = {base, segment, small};
    held.segment_bytes += segment;
    held.cached_blocks[base] = {segment, id, true};
    found = pool.insert({segment, base}).first;
  }
  char* start = found->second;
  pool.erase(found);
  Resources::CachedBlock& block = held.cached_blocks[start];
  const size_t remaining = block.bytes - size;
  if (small ? remaining >= kMinBlockSize : remaining > kSmallSize) {
    held.cached_blocks[start + size] = {remaining, block.segment, true};
    pool.insert({remaining, start + size});
    held.cached_blocks[start].bytes = size;
  }
  held.cached_blocks[start].free = false;
  return start;
}

void Compute::caching_give_back(char* start) {
  Resources& held = *resources_;  // what this Compute holds: allocations, the block, the pools
  auto block = held.cached_blocks.find(start);
  auto& pool = held.pool_of(block->second.segment);  // a block goes back to its segment's pool
  block->second.free = true;
  // Merge with the next block, then the previous, inside the same segment.
  auto next = std::next(block);
  if (next != held.cached_blocks.end() && next->second.free && next->second.segment == block->second.segment &&
      start + block->second.bytes == next->first) {
    pool.erase({next->second.bytes, next->first});
    block->second.bytes += next->second.bytes;
    held.cached_blocks.erase(next);
  }
  if (block != held.cached_blocks.begin()) {
    auto previous = std::prev(block);
    if (previous->second.free && previous->second.segment == block->second.segment &&
        previous->first + previous->second.bytes == start) {
      pool.erase({previous->second.bytes, previous->first});
      previous->second.bytes += block->second.bytes;
      held.cached_blocks.erase(block);
      block = previous;
    }
  }
  pool.insert({block->second.bytes, block->first});
}
// The one place memory is found. `from_stack` is a push (the arena's top).
void* Compute::take(size_t bytes, MemoryKind kind, bool from_stack) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  Resources& held = *resources_;  // what this Compute holds: allocations, the block, the pools
  const size_t rounded = block_round(bytes);
  if (allocator_ == Allocator::direct) {
    if (held.capacity > 0 && counters_.total_current + bytes > held.capacity) out_of_memory(bytes, kind);
    pointer = device_malloc(bytes);
    counters_.allocations += 1;
  } else if (allocator_ == Allocator::caching) {
    pointer = caching_take(bytes, kind);
    counters_.allocations += 1;
  } else if (allocator_ == Allocator::arena) {
    const size_t offset = from_stack ? arena_push(held.arena, rounded) : arena_allocate(held.arena, rounded);
    if (offset == arena_full) out_of_memory(bytes, kind);
    pointer = held.block + offset;
    (from_stack ? counters_.pushes : counters_.allocations) += 1;
  } else {
    // Best fit: the smallest free piece that holds the request, the lowest
    // such on a tie; the request takes the piece's start.
    auto best = held.free_pieces.end();
    for (auto piece = held.free_pieces.begin(); piece != held.free_pieces.end(); ++piece)
      if (piece->second >= rounded && (best == held.free_pieces.end() || piece->second < best->second)) best = piece;
    if (best == held.free_pieces.end()) out_of_memory(bytes, kind);
    const size_t offset = best->first, left = best->second - rounded;
    held.free_pieces.erase(best);
    if (left > 0) held.free_pieces[offset + rounded] = left;
    pointer = held.block + offset;
    held.end = std::max(held.end, offset + rounded);
    counters_.allocations += 1;
  }
  // Zeroed (a pushed activations buffer: as set_activation_fill says), on
  // the compute stream. Model buffers (activations) are used on that stream
  // only, so stream order is enough; the engine's buffers are
  // made at start-up and also touched by the comm stream, so we wait.
  const PushFill fill = from_stack && kind == MemoryKind::activations ? activation_fill_ : PushFill::zero;
  if (fill != PushFill::none) fill_bytes(pointer, fill == PushFill::poison ? 0xff : 0, bytes, compute_stream_);
  if (kind != MemoryKind::activations) synchronize(compute_stream_);
  count(pointer, bytes, kind);
  return pointer;
}

void Compute::give_back(void* pointer, bool from_stack) {
  if (!pointer) return;
  Resources& held = *resources_;  // what this Compute holds: allocations, the block, the pools
  auto found = held.allocations.find(pointer);
  if (found == held.allocations.end()) usage_error("release of a pointer this Compute did not allocate");
  const size_t bytes = found->second.first;
  const MemoryKind kind = found->second.second;
  counters_.current[(int)kind] -= bytes;
  counters_.total_current -= bytes;
  held.allocations.erase(found);
  const size_t rounded = block_round(bytes);
  // Nothing queued may still use what we give back. Model buffers
  // (activations) in the block need no wait: they are used on the compute
  // stream (or after an event on it), where the next user is queued after
  // their last use. The engine's buffers are also read by the comm stream,
  // and cudaFree's wait for the device is not a documented promise.
  if (allocator_ == Allocator::direct || kind != MemoryKind::activations) synchronize_all();
  if (allocator_ == Allocator::direct) {
    device_free(pointer);
  } else if (allocator_ == Allocator::caching) {
    caching_give_back((char*)pointer);
  } else if (allocator_ == Allocator::arena) {
    const size_t offset = held.offset_of(pointer);
    if (from_stack) arena_pop(held.arena, offset, rounded);
    else arena_release(held.arena, offset, rounded);
  } else {
    // Return the piece and merge it with free neighbours on both sides.
    size_t offset = held.offset_of(pointer), size = rounded;
    auto next = held.free_pieces.lower_bound(offset);
    if (next != held.free_pieces.end() && offset + size == next->first) {
      size += next->second;
      next = held.free_pieces.erase(next);
    }
    if (next != held.free_pieces.begin()) {
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        offset = previous->first;
        size += previous->second;
        held.free_pieces.erase(previous);
      }
    }
    held.free_pieces[offset] = size;
  }
  counters_.reserved_current = reserved_now();
  sample();
}

// The block's used part now (see "reserved =" above).
size_t Compute::reserved_now() const {
  switch (allocator_) {
    case Allocator::arena: return resources_->arena.bottom + (resources_->capacity - resources_->arena.top);
    case Allocator::naive: return resources_->end;
    case Allocator::caching: return resources_->segment_bytes;
    default: return counters_.total_current;
  }
}

// The memory ledger is these counters: the bytes actually handed out, by kind,
// now and at their peak.
void Compute::count(void* pointer, size_t bytes, MemoryKind kind) {
  resources_->allocations[pointer] = {bytes, kind};
  counters_.current[(int)kind] += bytes;
  counters_.peak[(int)kind] = std::max(counters_.peak[(int)kind], counters_.current[(int)kind]);
  counters_.total_current += bytes;
  counters_.total_peak = std::max(counters_.total_peak, counters_.total_current);
  counters_.reserved_current = reserved_now();
  counters_.reserved_peak = std::max(counters_.reserved_peak, counters_.reserved_current);
  sample();
}

void Compute::sample() {
  if (!tracing_) return;
  size_t free_total = 0, pieces = 0, largest = 0;
  free_space(&free_total, &pieces, &largest);
  trace_.push_back(
      {counters_.total_current, counters_.reserved_current, counters_.current[(int)MemoryKind::activations], pieces});
}

void Compute::set_tracing(bool on) {
  tracing_ = on;
  if (!on) return;
  trace_.clear();
  sample();
}

void Compute::reset_peaks() {
  for (int k = 0; k < (int)MemoryKind::count; ++k) counters_.peak[k] = counters_.current[k];
  counters_.total_peak = counters_.total_current;
  counters_.reserved_peak = counters_.reserved_current;
  counters_.host_pinned_peak = counters_.host_pinned_current;
  counters_.host_offload_peak = counters_.host_offload_current;
}

void* Compute::allocate(size_t bytes, MemoryKind kind) { return take(bytes, kind, false); }
void Compute::release(void* pointer) { give_back(pointer, false); }
void* Compute::push(size_t bytes, MemoryKind kind) { return take(bytes, kind, true); }
void Compute::pop(void* pointer) { give_back(pointer, true); }

// Page-locked host memory (plain aligned memory on cpu), zeroed.
static void* host_memory(size_t bytes, Device device) {
  void* pointer = nullptr;
  if (device != Device::cuda) {
    pointer = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!pointer) abort_all_ranks("memory", "out of host memory", "pinned host buffer", __FILE__, __LINE__);
  } else {
#if defined(Z2_HAVE_CUDA)
    // Page-locked: cudaMemcpyAsync from pageable memory silently serializes.
    Z2_CUDA_CHECK(cudaMallocHost(&pointer, bytes));
#endif
  }
  std::memset(pointer, 0, bytes);
  return pointer;
}

void* Compute::allocate_host_pinned(size_t bytes, bool offload) {
  if (bytes == 0) return nullptr;
  void* pointer = host_memory(bytes, device_);
  resources_->pinned[pointer] = {
      bytes, offload ? Resources::PinnedBuffer::Use::activation_offload : Resources::PinnedBuffer::Use::comm_staging};
  size_t& current = offload ? counters_.host_offload_current : counters_.host_pinned_current;
  size_t& peak = offload ? counters_.host_offload_peak : counters_.host_pinned_peak;
  current += bytes;
  peak = std::max(peak, current);
  return pointer;
}

void* Compute::allocate_host(size_t bytes, MemoryKind kind) {
  if (bytes == 0) return nullptr;
  void* pointer = host_memory(bytes, device_);
  resources_->pinned[pointer] = {bytes, Resources::PinnedBuffer::Use::offloaded_state, kind};
  counters_.host_current[(int)kind] += bytes;
  return pointer;
}

void Compute::release_host_pinned(void* pointer) {
  if (!pointer) return;
  const Resources::PinnedBuffer recorded = resources_->pinned.at(pointer);
  switch (recorded.use) {
    case Resources::PinnedBuffer::Use::comm_staging: counters_.host_pinned_current -= recorded.bytes; break;
    case Resources::PinnedBuffer::Use::activation_offload: counters_.host_offload_current -= recorded.bytes; break;
    case Resources::PinnedBuffer::Use::offloaded_state:
      counters_.host_current[(int)recorded.kind] -= recorded.bytes;
      break;
  }
  resources_->pinned.erase(pointer);
  if (device_ != Device::cuda) {
    std::free(pointer);
    return;
  }
#if defined(Z2_HAVE_CUDA)
  Z2_CUDA_CHECK(cudaFreeHost(pointer));
#endif
}
}  // namespace z2
