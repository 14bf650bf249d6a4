// expect: a prefetch after use
// A planted mistake for the offload lab: the checkpoint of the block that just ran.
#include "zero2.h"
int z2::checkpoint_to_prefetch(int block, int layers) { return block + 1 <= layers - 2 ? block + 1 : -1; }
