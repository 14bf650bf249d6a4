// expect: you split at n / 2
// A planted mistake for the tree-sum lab: a balanced split at n / 2.
#include "zero2.h"
float z2::tree_sum(long n, const float* leaves) {
  if (n == 0) return 0.0f;
  if (n == 1) return leaves[0];
  return tree_sum(n / 2, leaves) + tree_sum(n - n / 2, leaves + n / 2);
}
