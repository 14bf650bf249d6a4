// expect: you added left to right
// A planted mistake for the tree-sum lab: the sequential sum.
#include "zero2.h"
float z2::tree_sum(long n, const float* leaves) {
  float sum = 0;
  for (long k = 0; k < n; ++k) sum += leaves[k];
  return sum;
}
