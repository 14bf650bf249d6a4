// expect: no wait at all
// A planted mistake for the streams lab: the copy is queued on the copy stream with no wait for the
// compute stream's work before it (the checkpoint may not be written yet, its slot may still be read).
#include "zero2.h"
void z2::checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                         Event copied) {
  compute.copy(destination, source, bytes, compute.copy_stream());
  compute.record(copied, compute.copy_stream());
}
