// expect: recorded on the copy stream before the copy
// A planted mistake for the streams lab: `copied` is recorded before the copy is queued, so it stands
// for the copy stream's work up to the wait, not for the copy; the compute stream's wait for it is met
// while the copy is still to run.
#include "zero2.h"
void z2::checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                         Event copied) {
  compute.record(ready, compute.compute_stream());
  compute.wait(compute.copy_stream(), ready);
  compute.record(copied, compute.copy_stream());
  compute.copy(destination, source, bytes, compute.copy_stream());
}
