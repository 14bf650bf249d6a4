// notes/labs/offload/skeleton.cpp — lab: activation offload, the schedule of
// the checkpoints' trips back from the host (ZeRO-R).
// Copy this file, write checkpoint_to_prefetch, and grade it:
//   make lab LAB=offload SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/offload/README.md.
#include "zero2.h"

namespace z2 {

// A model of `layers` blocks: checkpoint l (block l's input) is on the host
// during backward for l = 0 .. layers-2. Backward runs block = layers-1 down
// to 0. Before block `block`'s backward, which checkpoint should start its
// copy back to the device? -1 for none.
int checkpoint_to_prefetch(int block, int layers) {
  // Yours here.
  return -1;
}

}  // namespace z2
