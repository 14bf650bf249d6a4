// notes/labs/tree-sum/skeleton.cpp — lab: the canonical summation tree.
// Copy this file, write tree_sum, and grade it:
//   make lab LAB=tree-sum SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/tree-sum/README.md.
#include "zero2.h"

namespace z2 {

// leaves [n] -> their sum as the canonical tree: a range of n > 1 leaves
// splits after its first p leaves, p the largest power of two below n, and
// each side is summed the same way. The sum of no leaves is +0.
float tree_sum(long n, const float* leaves) {
  // Your tree here. (0 is right for n = 0 only.)
  return 0.0f;
}

}  // namespace z2
