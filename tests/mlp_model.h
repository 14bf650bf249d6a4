// tests/mlp_model.h — a small multi-layer perceptron trained through the zero2
// engine: the test model of the engine's tests and of the stage demo.
//
// x [B, input] -> L layers (Linear + tanh, the last without tanh) -> logits
// [B, classes] -> softmax cross-entropy. Labels come from a fixed random
// "teacher" layer, so the loss has something to learn and falls.
//
// Backward walks the layers from the last to the first and hands each
// gradient to the engine as soon as it is written, so stage 2 reduces the top
// layers' buckets while the lower layers are still in backward: the same
// pattern BERT will produce, on a model small enough to test exhaustively.
#pragma once

#include "../zero2.h"

namespace mlp {

struct Config {
  int input = 24, hidden = 40, layers = 3, classes = 10;
  int micro_batch = 8;  // samples per micro-batch
  uint64_t seed = 1234;
};

class Model {
 public:
  // Registers the parameters with `engine` (weight then bias, layer by layer).
  Model(z2::Compute& compute, z2::Engine& engine, const Config& config);
  ~Model();

  // After engine.build(): the same initial values on every rank, keyed by
  // (seed, parameter, element), so N does not change them.
  void initialize();
  // One micro-step of optimizer step `step` (0-based): forward, backward, hand
  // the gradients over, engine.end_micro_step(loss). Returns the loss
  // contribution of this micro-batch (sum of its losses / global sample count).
  float micro_step(long step, int micro_step);
  // A whole optimizer step: accumulation_steps micro-steps, then engine.step().
  z2::StepReport train_step(long step);

  size_t parameter_count() const;

 private:
  struct Buffers;
  z2::Compute& compute_;
  z2::Engine& engine_;
  Config config_;
  std::vector<z2::ParameterId> weights_, biases_;
  std::vector<int> widths_;  // layer widths: input, hidden..., classes
  Buffers* buffers_;
};

}  // namespace mlp
