// expect: halves at the h-th overflow
// A planted mistake for the loss-scale lab: every overflow halves, whatever the hysteresis.
#include <algorithm>

#include "zero2.h"
void z2::LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    if (scale_ == settings_.min_scale) usage_error("loss scale at its minimum");
    scale_ = std::max(scale_ / 2, settings_.min_scale);
    last_overflow_ = iteration_;
  } else if ((iteration_ - last_overflow_) % settings_.window == 0) {
    scale_ *= 2;
  }
  iteration_ += 1;
}
