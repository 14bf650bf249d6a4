// expect: a scale that never grows
// A planted mistake for the loss-scale lab: the scale halves on overflow and never doubles.
#include <algorithm>

#include "zero2.h"
void z2::LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    if (settings_.hysteresis == 1 || hysteresis_left_ == 1) {
      if (scale_ == settings_.min_scale) usage_error("loss scale at its minimum");
      scale_ = std::max(scale_ / 2, settings_.min_scale);
    } else {
      hysteresis_left_ -= 1;
    }
    last_overflow_ = iteration_;
  }
  iteration_ += 1;
}
