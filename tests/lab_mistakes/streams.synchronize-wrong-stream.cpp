// expect: synchronized the compute stream
// A planted mistake for the streams lab: instead of recording `copied`, the host synchronizes the
// compute stream to "make sure the copy is done"; the copy is on the copy stream, so it is not, and
// `copied`, never recorded, counts as complete.
#include "zero2.h"
void z2::checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                         Event copied) {
  compute.record(ready, compute.compute_stream());
  compute.wait(compute.copy_stream(), ready);
  compute.copy(destination, source, bytes, compute.copy_stream());
  compute.synchronize(compute.compute_stream());
}
