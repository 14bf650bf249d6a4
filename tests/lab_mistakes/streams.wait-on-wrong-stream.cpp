// expect: the copy stream never waited for it
// A planted mistake for the streams lab: the compute stream is made to wait for `ready`, its own
// event (which waits for nothing); the copy stream, which had to wait, does not.
#include "zero2.h"
void z2::checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                         Event copied) {
  compute.record(ready, compute.compute_stream());
  compute.wait(compute.compute_stream(), ready);
  compute.copy(destination, source, bytes, compute.copy_stream());
  compute.record(copied, compute.copy_stream());
}
