// measurements/math_accuracy.cpp — prints the accuracy of zero2's exp, log and erf
// (zero2.h) over every float input, or every stride-th (tests/math_accuracy.h
// says against what). `make math-accuracy` runs it; notes/07 shows its table.
//   build/math_accuracy [--stride S] [--threads T]
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tests/math_accuracy.h"

int main(int argc, char** argv) {
  uint64_t stride = 1;
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--stride") && i + 1 < argc) {
      stride = strtoull(argv[++i], nullptr, 10);
    } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
      threads = (unsigned)strtoul(argv[++i], nullptr, 10);
    } else {
      fprintf(stderr, "usage: %s [--stride S] [--threads T]   (S >= 1: every S-th float bit pattern)\n", argv[0]);
      return 2;
    }
  }
  if (stride < 1 || threads < 1) {
    fprintf(stderr, "math_accuracy: --stride and --threads must be at least 1\n");
    return 2;
  }
  printf(
      "| function | float inputs (finite results) | max error (ulps) | at x = | not correctly rounded | "
      "wrong inf / NaN / sign of zero |\n");
  printf("|---|---|---|---|---|---|\n");
  int status = 0;
  for (auto function : {math_accuracy::Function::exp, math_accuracy::Function::log, math_accuracy::Function::erf}) {
    const math_accuracy::Result r = math_accuracy::measure(function, stride, threads);
    printf("| %s | %llu | %.6f | %.9g | %llu | %llu |\n", math_accuracy::name(function), (unsigned long long)r.inputs,
           r.max_ulps, r.worst_input, (unsigned long long)(r.inputs - r.correctly_rounded),
           (unsigned long long)r.wrong_special);
    fflush(stdout);
    if (r.wrong_special != 0) status = 1;
  }
  return status;
}
