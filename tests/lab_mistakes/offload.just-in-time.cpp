// expect: fetch one block ahead
// A planted mistake for the offload lab: each block fetches its own checkpoint (correct bits, no overlap).
#include "zero2.h"
int z2::checkpoint_to_prefetch(int block, int layers) { return block <= layers - 2 ? block : -1; }
