// notes/labs/streams/skeleton.cpp — lab: the waits of one transfer, a
// checkpoint's copy between the compute stream's work (ZeRO-R's activation
// offload, graded on the simulated device).
// Copy this file, place the waits in checkpoint_copy, and grade it:
//   make lab LAB=streams SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/streams/README.md.
#include "zero2.h"

namespace z2 {

// Copy `bytes` from `source` to `destination` on the copy stream, after the
// work the compute stream has queued so far, and record `copied` where the
// copy is done (the model makes the compute stream wait for it). `ready` is
// yours to record. The calls: compute.record(event, stream),
// compute.wait(waiting_stream, event), compute.copy(destination, source,
// bytes, stream); the streams: compute.compute_stream(), compute.copy_stream().
void checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                     Event copied) {
  // Yours here: what must the copy wait for?
  compute.copy(destination, source, bytes, compute.copy_stream());
  // And what tells the compute stream that the copy is done?
}

}  // namespace z2
