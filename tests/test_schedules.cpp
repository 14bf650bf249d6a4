// tests/test_schedules.cpp — DeepSpeed's WarmupCosineLR, OneCycle (with its
// beta1 cycle) and LRRangeTest as trainer/settings.cpp computes them, against
// rates worked out by hand from lr_schedules.py (DeepSpeed v0.16.9) in the
// comments; and the refusals of check_consistency (trainer/settings.cpp,
// check_scheduler). Update t runs at the scheduler's iteration i = t - 2:
// update 1 at the rate the scheduler's constructor sets (i = -1), update 2
// at i = 0 after the first step() (engine.py _take_model_step).
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "trainer/settings.h"

namespace {

bert::Settings deepspeed(const std::string& scheduler) {
  bert::Settings s;
  s.schedule_convention = "deepspeed";
  s.scheduler = scheduler;
  return s;
}

// The message check_consistency refuses with, or "" when it accepts.
std::string refusal(bert::Settings s, int world_size = 2) {
  try {
    bert::check_consistency(s, world_size);
  } catch (const std::exception& error) { return error.what(); }
  return "";
}

}  // namespace

TEST_CASE("DeepSpeed's WarmupCosineLR, step by step: warmup, cosine, and past total_num_steps") {
  bert::Settings s = deepspeed("WarmupCosineLR");
  s.lr = 1.0, s.warmup = 4, s.schedule_steps = 10, s.warmup_type = "linear";
  s.warmup_min_ratio = 0.2, s.cos_min_ratio = 0.0;
  // i = -1: get_lr returns [0.0] (lr_schedules.py:855-856): update 1 learns nothing.
  CHECK(bert::learning_rate(s, 1) == 0.0);
  // Linear warmup, W = 4: 0.2 + (i / 4) 0.8: i = 0 -> 0.2, i = 2 -> 0.6.
  CHECK(bert::learning_rate(s, 2) == doctest::Approx(0.2).epsilon(1e-15));
  CHECK(bert::learning_rate(s, 4) == doctest::Approx(0.6).epsilon(1e-15));
  // i = W = 4: r = i - W + 1 = 1, T = S - W = 6: (1 + cos(pi / 6)) / 2 = (1 + sqrt(3) / 2) / 2.
  CHECK(bert::learning_rate(s, 6) == doctest::Approx((1 + std::sqrt(3.0) / 2) / 2).epsilon(1e-15));
  // i = 6: r = 3, cos(pi / 2) = 0: one half.
  CHECK(bert::learning_rate(s, 8) == doctest::Approx(0.5).epsilon(1e-15));
  // i = S - 1 = 9: r = 6, cos(pi) = -1: cos_min_ratio x lr, here exactly 0.
  CHECK(bert::learning_rate(s, 11) == 0.0);
  // Past S nothing clamps (:840-844): i = 10, r = 7, (1 + cos(7 pi / 6)) / 2 = (1 - sqrt(3) / 2) / 2, rising.
  CHECK(bert::learning_rate(s, 12) == doctest::Approx((1 - std::sqrt(3.0) / 2) / 2).epsilon(1e-12));
  // i = 21: r = 18, cos(3 pi) = -1 again (the argument reduced by the period 2T = 12): 0.
  CHECK(bert::learning_rate(s, 23) == 0.0);
  // cos_min_ratio 0.1 at r = 3: 0.1 + 0.9 x 0.5 = 0.55; the peak scales every rate (lr 2: 1.1).
  s.cos_min_ratio = 0.1, s.lr = 2.0;
  CHECK(bert::learning_rate(s, 8) == doctest::Approx(1.1).epsilon(1e-15));
  // Log warmup, wmin 0, lr 1: (1 / ln 4) ln(i + 1): i = 1 -> ln 2 / ln 4 = 1/2, i = 3 -> 1.
  s.lr = 1.0, s.warmup_min_ratio = 0.0, s.warmup_type = "log";
  CHECK(bert::learning_rate(s, 2) == 0.0);  // ln 1 = 0
  CHECK(bert::learning_rate(s, 3) == doctest::Approx(0.5).epsilon(1e-15));
  CHECK(bert::learning_rate(s, 5) == doctest::Approx(1.0).epsilon(1e-15));
  // warmup_num_steps 0 is raised to W = 2 (:814): linear i = 1 -> 1/2.
  s.warmup = 0, s.warmup_type = "linear";
  CHECK(bert::learning_rate(s, 3) == 0.5);
}

TEST_CASE("DeepSpeed's OneCycle, step by step: the rate's cycle and decay, and beta1's inverse cycle with beta2 0.99") {
  bert::Settings s = deepspeed("OneCycle");
  s.cycle_min_lr = 1.0, s.cycle_max_lr = 3.0, s.cycle_first_step_size = 4, s.cycle_second_step_size = 2;
  s.decay_step_size = 2, s.decay_lr_rate = 0.5, s.cycle_min_mom = 0.8, s.cycle_max_mom = 0.9, s.decay_mom_rate = 0.05;
  using Betas = std::pair<double, double>;
  // i = -1: __init__ sets cycle_min_lr and (cycle_min_mom, 0.99) (:497-499, :518-523).
  CHECK(bert::learning_rate(s, 1) == 1.0);
  CHECK(bert::adam_betas(s, 1) == Betas(0.8, 0.99));
  // total = 6, step_ratio = 4/6. i = 0: b = 1, x = 1/6 <= 2/3, scale = (1/6) / (2/3) = 1/4:
  // lr 1 + 2/4 = 1.5, beta1 0.9 - 0.1/4 = 0.875.
  CHECK(bert::learning_rate(s, 2) == doctest::Approx(1.5).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 2).first == doctest::Approx(0.875).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 2).second == 0.99);
  // i = 3: b = 4, x = 2/3: the peak, lr 3 and beta1 0.8.
  CHECK(bert::learning_rate(s, 5) == doctest::Approx(3.0).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 5).first == doctest::Approx(0.8).epsilon(1e-15));
  // i = 4: b = 5, x = 5/6 > 2/3: scale (5/6 - 1) / (2/3 - 1) = 1/2: lr 2, beta1 0.85.
  CHECK(bert::learning_rate(s, 6) == doctest::Approx(2.0).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 6).first == doctest::Approx(0.85).epsilon(1e-15));
  // i = 5 < total: b = 6, cycle = floor(2) = 2, x = 0: scale 0, lr 1, beta1 0.9.
  CHECK(bert::learning_rate(s, 7) == 1.0);
  CHECK(bert::adam_betas(s, 7).first == 0.9);
  // i = 6 >= total: d = 1, interval 1/2: lr 1 / (1 + 0.5 x 0.5) = 0.8; beta1 0.9 (1 + 0.05 x 0.5) = 0.9225.
  CHECK(bert::learning_rate(s, 8) == doctest::Approx(0.8).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 8).first == doctest::Approx(0.9225).epsilon(1e-15));
  // i = 9: d = 4, interval 2: lr 1/2, beta1 0.9 x 1.1 = 0.99.
  CHECK(bert::learning_rate(s, 11) == doctest::Approx(0.5).epsilon(1e-15));
  CHECK(bert::adam_betas(s, 11).first == doctest::Approx(0.99).epsilon(1e-15));
  // decay_step_size 0 skips both decays (:487-492): cycle_min_lr and cycle_max_mom after the cycle.
  s.decay_step_size = 0;
  CHECK(bert::learning_rate(s, 20) == 1.0);
  CHECK(bert::adam_betas(s, 20) == Betas(0.9, 0.99));
  // cycle_second_step_size None (-1): the first's, total 8, ratio 1/2. i = 1: b = 2, x = 1/4, scale 1/2: lr 2.
  s.cycle_second_step_size = -1;
  CHECK(bert::learning_rate(s, 3) == doctest::Approx(2.0).epsilon(1e-15));
  // cycle_momentum false: the optimizer's own betas at every update.
  s.cycle_momentum = false, s.beta1 = 0.7, s.beta2 = 0.95;
  CHECK(!bert::betas_cycle(s));
  CHECK(bert::adam_betas(s, 1) == Betas(0.7, 0.95));
  CHECK(bert::adam_betas(s, 5) == Betas(0.7, 0.95));
  // Not OneCycle: the optimizer's betas too.
  bert::Settings other = deepspeed("WarmupCosineLR");
  CHECK(!bert::betas_cycle(other));
}

TEST_CASE("DeepSpeed's LRRangeTest, step by step: continuous and staircase") {
  bert::Settings s = deepspeed("LRRangeTest");
  s.lr_range_test_min_lr = 0.5, s.lr_range_test_step_size = 4, s.lr_range_test_step_rate = 2.0;
  // i = -1: __init__ sets lr_range_test_min_lr (:336-337).
  CHECK(bert::learning_rate(s, 1) == 0.5);
  // min (1 + rate (i + 1) / size): i = 0 -> 0.5 (1 + 2/4) = 0.75; i = 3 -> 0.5 x 3 = 1.5; i = 5 -> 0.5 (1 + 3) = 2.
  CHECK(bert::learning_rate(s, 2) == 0.75);
  CHECK(bert::learning_rate(s, 5) == 1.5);
  CHECK(bert::learning_rate(s, 7) == 2.0);
  // staircase: floor((i + 1) / size): i = 0 -> 0: 0.5; i = 3 -> 1: 1.5; i = 5 -> floor(1.5) = 1: 1.5.
  s.lr_range_test_staircase = true;
  CHECK(bert::learning_rate(s, 2) == 0.5);
  CHECK(bert::learning_rate(s, 5) == 1.5);
  CHECK(bert::learning_rate(s, 7) == 1.5);
}

TEST_CASE(
    "DeepSpeed's schedulers: a WarmupCosineLR that divides by zero, and a OneCycle beta1 that reaches 1, refused") {
  bert::Settings s = deepspeed("WarmupCosineLR");
  s.steps = 20, s.warmup = 4, s.schedule_steps = 4;
  s.origins["--schedule-steps"] = "config:scheduler.params.total_num_steps";
  s.origins["--warmup"] = "config:scheduler.params.warmup_num_steps";
  const std::string equal = refusal(s);
  CHECK_MESSAGE(equal.find("config key 'scheduler.params.total_num_steps' 4 equals the warmup's 4 iterations") !=
                    std::string::npos,
                equal);
  CHECK(equal.find("config key 'scheduler.params.warmup_num_steps' 4") != std::string::npos);
  CHECK(equal.find("ZeroDivisionError") != std::string::npos);
  s.warmup = 1, s.schedule_steps = 2;  // W = max(2, 1) = 2 = S: the same division
  CHECK(refusal(s).find("equals the warmup's 2 iterations") != std::string::npos);
  s.schedule_steps = 3;
  CHECK(refusal(s) == "");
  // OneCycle's beta1 after the cycle: 0.9 (1 + 0.05 d / 2) reaches 1 at d = 5 (1.0125), i = total + d - 1 = 10,
  // update 12 (total 6, as the test above): refused at 12 steps, taken at 11 (0.99).
  bert::Settings one = deepspeed("OneCycle");
  one.cycle_min_lr = 1.0, one.cycle_max_lr = 3.0, one.cycle_first_step_size = 4, one.cycle_second_step_size = 2;
  one.decay_step_size = 2, one.decay_mom_rate = 0.05, one.steps = 11;
  one.origins["decay_mom_rate"] = "config:scheduler.params.decay_mom_rate";
  CHECK(refusal(one) == "");
  one.steps = 40;
  const std::string beta = refusal(one);
  CHECK_MESSAGE(beta.find("config key 'scheduler.params.decay_mom_rate' 0.05 takes OneCycle's beta1 to 1.0125") !=
                    std::string::npos,
                beta);
  CHECK(beta.find("at update 12 of this run's 40") != std::string::npos);
  one.cycle_momentum = false;  // the rate alone: beta1 is the optimizer's
  CHECK(refusal(one) == "");
}

TEST_CASE("DeepSpeed's schedulers' params: each out of its range refused, naming the key") {
  struct Case {
    const char *flag, *value, *says;
  };
  for (const Case& c : {Case{"cycle_first_step_size", "0", "wants an integer from 1"},
                        Case{"cycle_first_step_size", "-3", "wants an integer from 1"},
                        Case{"cycle_second_step_size", "-1", "wants an integer from 0"},
                        Case{"decay_step_size", "-2", "wants an integer from 0"},
                        Case{"decay_lr_rate", "-0.5", "wants a number from 0"},
                        Case{"cycle_min_mom", "1", "wants a number from 0 to 1 (exclusive)"},
                        Case{"cycle_max_lr", "-1e-3", "wants a number from 0"},
                        Case{"lr_range_test_step_size", "0", "wants an integer from 1"},
                        Case{"lr_range_test_step_rate", "-1", "wants a number from 0"},
                        Case{"warmup_min_ratio", "1.5", "wants a number from 0 to 1"},
                        Case{"cos_min_ratio", "-0.1", "wants a number from 0 to 1"},
                        Case{"scheduler", "CosineAnnealingLR", "wants warmup|WarmupCosineLR|OneCycle|LRRangeTest"}}) {
    bert::Settings s;
    const std::string key = std::string("scheduler.params.") + c.flag;
    std::string message;
    try {
      bert::apply(s, c.flag, c.value, key);
    } catch (const std::exception& error) { message = error.what(); }
    CHECK_MESSAGE(message.find(key) != std::string::npos, c.flag, " ", c.value, ": ", message);
    CHECK_MESSAGE(message.find(c.says) != std::string::npos, c.flag, " ", c.value, ": ", message);
  }
}
