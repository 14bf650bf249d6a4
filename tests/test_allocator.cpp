// tests/test_allocator.cpp — --alloc caching against the rules of PyTorch's
// CUDA caching allocator as c10/cuda/CUDACachingAllocator.cpp states them
// (runtime/allocators.cpp lists them with the constants), on a scripted sequence
// of requests. Every expected value below is worked out by hand from those
// rules (MiB = 2^20 bytes), not by asking the allocator: the segments the
// device is asked for, which requests share a segment and at what offset, when
// a block is split, that blocks merge inside a segment only, and that a
// refused segment releases the wholly free cached segments and retries once.
// Rank-local (a cpu Compute of its own), so every rank runs it alone.
#include <cstring>
#include <string>

#include "harness.h"

using harness::agree;

namespace {

constexpr size_t MiB = 1 << 20;

// The device allocations made so far and the bytes they hold (the caching
// allocator's "reserved"), as the ledger counts them.
struct Device {
  long segments;
  size_t reserved;
};
Device device_of(const z2::Compute& compute) {
  return {compute.memory().device_mallocs, compute.memory().reserved_current};
}
bool same(Device measured, long segments, size_t reserved) {
  return measured.segments == segments && measured.reserved == reserved;
}

}  // namespace

TEST_CASE("caching allocator: rounding, pools, segment sizes, splitting, merging, release and retry") {
  bool ok = true;
  std::string failures;
  auto expect = [&](bool condition, const char* what) {
    if (!condition) failures += std::string(" ") + what + ";";
    ok &= condition;
  };
  try {
    z2::Compute compute(z2::Device::cpu);
    compute.use_allocator(z2::Allocator::caching, 50 * MiB);  // the "device": 50 MiB
    const auto kind = z2::MemoryKind::activations;

    // 100 bytes: rounded to 512, a small request, so a 2 MiB small segment (S1).
    char* a = (char*)compute.allocate(100, kind);
    expect(same(device_of(compute), 1, 2 * MiB), "a small request gets a 2 MiB segment");
    // 1 MiB is still small (<= kSmallSize): the rest of S1 holds it, right
    // after the first block's 512 bytes (split: 2 MiB - 512 >= 512 was left).
    char* b = (char*)compute.allocate(MiB, kind);
    expect(same(device_of(compute), 1, 2 * MiB), "1 MiB fits the small segment's rest");
    expect(b == a + 512, "the small block was split after 512 bytes");

    // 1 MiB + 1 byte: rounded to 1 MiB + 512, large; below 10 MiB, so a
    // 20 MiB segment (L1), split (19 MiB - 512 > 1 MiB left).
    char* c = (char*)compute.allocate(MiB + 1, kind);
    expect(same(device_of(compute), 2, 22 * MiB), "1 MiB + 1 gets a 20 MiB large segment");
    // 9 MiB: L1's rest is the best fit; split again (10 MiB - 1024 left).
    char* d = (char*)compute.allocate(9 * MiB, kind);
    expect(same(device_of(compute), 2, 22 * MiB), "9 MiB fits the large segment's rest");
    expect(d == c + MiB + 512, "the large block was split after 1 MiB + 512");
    // 12 MiB: L1's rest (10 MiB - 1024) is too small; >= 10 MiB, so a segment
    // of the request rounded up to 2 MiB (L2, exactly 12 MiB, nothing left).
    char* e = (char*)compute.allocate(12 * MiB, kind);
    expect(same(device_of(compute), 3, 34 * MiB), "12 MiB gets its own 12 MiB segment");

    // Freeing c leaves a hole that cannot merge (d is live next to it);
    // freeing d merges c, d and L1's rest into the whole 20 MiB again.
    compute.release(c);
    compute.release(d);
    char* f = (char*)compute.allocate(19 * MiB, kind);
    expect(same(device_of(compute), 3, 34 * MiB), "freed neighbours merged into the whole segment");
    expect(f == c, "the merged block starts the segment");
    // Free now: the 16 MiB the device has not given out, and S1's rest
    // (2 MiB - 512 - 1 MiB); f's 1 MiB rest is no free block (see below).
    size_t free_bytes = 0, pieces = 0, largest = 0;
    compute.free_space(&free_bytes, &pieces, &largest);
    expect(free_bytes == 17 * MiB - 512 && pieces == 2 && largest == 16 * MiB, "f was not split");
    // f keeps all 20 MiB: its rest, 1 MiB, is not > 1 MiB, so it was not
    // split. A 1 MiB + 512 request finds no free large block and asks for a
    // 20 MiB segment: 34 + 20 > 50. No cached segment is wholly free (S1
    // holds a and b, L1 f, L2 e), so the retry fails too: out of memory,
    // with nothing reserved or released.
    bool refused = false;
    try {
      compute.allocate(MiB + 512, kind);
    } catch (const z2::OutOfMemory& error) {
      refused = std::string(error.what()).find("--alloc caching") != std::string::npos;
    }
    expect(refused, "a segment over the device's 50 MiB is refused with the caching allocator's message");
    expect(same(device_of(compute), 3, 34 * MiB), "a refused request reserves nothing");

    // Free f and e: L1 (20 MiB) and L2 (12 MiB) stay cached, wholly free;
    // reserved does not go down (segments are never given back).
    compute.release(f);
    compute.release(e);
    expect(same(device_of(compute), 3, 34 * MiB), "freed segments stay cached");
    // 30 MiB: 32 MiB are free in the cache, but in two segments that never
    // merge, so it needs a 30 MiB segment: 34 + 30 > 50. The wholly free L1
    // and L2 are released (34 - 32 = 2 MiB reserved) and the retry fits.
    char* g = (char*)compute.allocate(30 * MiB, kind);
    expect(same(device_of(compute), 4, 32 * MiB), "a refused segment released the free cached ones, then fit");

    // The small pool is apart from the large one: 600 KiB comes from S1's
    // rest (after a and b: 1 MiB - 512 free), right after b.
    char* h = (char*)compute.allocate(600 << 10, kind);
    expect(h == b + MiB && same(device_of(compute), 4, 32 * MiB), "a small request uses the small segment's rest");
    // 513 bytes round to 1024, so the next block starts 1024 bytes later.
    char* i = (char*)compute.allocate(513, kind);
    char* j = (char*)compute.allocate(1, kind);
    expect(i == h + (600 << 10) && j == i + 1024, "sizes round up to multiples of 512");
    for (char* pointer : {a, b, g, h, i, j}) compute.release(pointer);
    expect(compute.memory().total_current == 0 && same(device_of(compute), 4, 32 * MiB),
           "all freed: nothing live, the segments still cached");
  } catch (const std::exception& error) {
    failures += std::string(" threw: ") + error.what();
    ok = false;
  }
  if (!ok) fprintf(stderr, "rank %d: caching allocator:%s\n", harness::rank(), failures.c_str());
  CHECK(agree(ok, "the caching allocator broke one of PyTorch's rules"));
}
