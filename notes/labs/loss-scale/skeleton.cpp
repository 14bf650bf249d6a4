// notes/labs/loss-scale/skeleton.cpp — lab: fp16's dynamic loss scaling.
// Copy this file, write LossScaler::update, and grade it:
//   make lab LAB=loss-scale SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/loss-scale/README.md.
#include "zero2.h"

namespace z2 {

// Called once per optimizer step, after the overflow check, with the same
// verdict on every rank. The members you read and write (zero2.h, class
// LossScaler): settings_ (window, hysteresis, consecutive_hysteresis,
// min_scale), dynamic_, scale_, hysteresis_left_, iteration_, last_overflow_.
void LossScaler::update(bool overflow) {
  if (!dynamic_) return;  // a static scale never changes
  // Yours here: halve on overflow (after `hysteresis` of them), double after
  // `window` clean steps, count the iteration.
}

}  // namespace z2
