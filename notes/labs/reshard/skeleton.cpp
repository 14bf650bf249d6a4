// notes/labs/reshard/skeleton.cpp — lab: resharding a checkpoint, loading
// optimizer state saved by N ranks into a run of N' ranks.
// Copy this file, write reshard_reads, and grade it:
//   make lab LAB=reshard SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/reshard/README.md.
#include "zero2.h"

namespace z2 {

// owned: the runs of the canonical order this rank owns, in order; files:
// the canonical range each checkpoint file holds, in order, together [0, Psi).
// Return the reads (file, canonical, length, into) that fill the owned
// state, the owned runs laid end to end.
std::vector<ReshardRead> reshard_reads(const std::vector<StateRun>& owned, const std::vector<StateRun>& files) {
  std::vector<ReshardRead> reads;
  // Yours here.
  return reads;
}

}  // namespace z2
