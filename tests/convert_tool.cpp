// tests/convert_tool.cpp — z2's 16-bit conversions as a filter, for
// tests/convert_check.py to compare with torch: reads little-endian float32
// values from stdin and writes, for each, its bf16 bits then its fp16 bits
// (two little-endian uint16). No MPI calls: zero2.h's conversions are inline.
//   build/convert_tool < floats.bin > bits.bin
#include <cstdio>
#include <vector>

#include "../zero2.h"

int main() {
  std::vector<float> values(1 << 16);
  std::vector<uint16_t> bits(2 * values.size());
  size_t count = 0;
  while ((count = std::fread(values.data(), sizeof(float), values.size(), stdin)) > 0) {
    for (size_t i = 0; i < count; ++i) {
      bits[2 * i] = z2::bf16_bits_from_float(values[i]);
      bits[2 * i + 1] = z2::fp16_bits_from_float(values[i]);
    }
    if (std::fwrite(bits.data(), sizeof(uint16_t), 2 * count, stdout) != 2 * count) return 1;
  }
  return std::ferror(stdin) ? 1 : 0;
}
