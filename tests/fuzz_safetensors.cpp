// tests/fuzz_safetensors.cpp — a libFuzzer target for the safetensors
// header and offsets parser (trainer/safetensors.h, safetensors_layout):
// arbitrary bytes in, a layout or a refusal (z2::Error) out. What it must
// never do: crash, read outside the bytes it was given, trip ASan or UBSan,
// or allocate for a size the bytes only claim (libFuzzer's -rss_limit_mb
// and -malloc_limit_mb catch that). When it accepts, the layout must tile
// the data exactly, which is checked again here from the outside.
//
// Built by `make build-sanitize/fuzz_safetensors` with clang++
// -fsanitize=fuzzer,address,undefined, and run by tests/sanitize.sh
// (`make sanitize`) for a fixed time from tests/safetensors_corpus/.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "../trainer/safetensors.h"
#include "../zero2.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bert::SafetensorsLayout layout;
  try {
    layout = bert::safetensors_layout("fuzz input", (const char*)data, size);
  } catch (const z2::Error&) {
    return 0;  // refused with a message: the expected outcome for nearly every input
  }
  // Accepted: every range lies in the data section, and the ranges, sorted,
  // abut from 0 to its end. A layout that breaks this is a parser bug.
  const size_t data_bytes = size - layout.data_start;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto& [name, tensor] : layout.tensors) ranges.push_back({tensor.begin, tensor.end});
  std::sort(ranges.begin(), ranges.end());
  size_t covered = 0;
  for (auto [begin, end] : ranges) {
    if (begin != covered || end < begin || end > data_bytes) abort();
    covered = end;
  }
  if (covered != data_bytes) abort();
  return 0;
}
