// tests/mlp_model.cu — the test model's forward and backward. Compiled by nvcc
// (cpu + cuda) or, in `make cpu`, by mpicxx as C++. Every per-element or
// per-row operation is one Z2_HD lambda run by Compute::for_each; the matrix
// products go to Compute::gemm (OpenBLAS or cuBLAS). No atomics: the bias
// gradient sums over the batch in a fixed order, one thread per column.
#include "mlp_model.h"

#include <cmath>

namespace mlp {

// ----------------------------------------------------------------------------
// Activations, one array per layer: inputs [B, widths[l]] and outputs.
struct Model::Buffers {
  std::vector<z2::DeviceArray<float>> activations;  // activations[l]: [B, widths[l]], l = 0..L
  std::vector<z2::DeviceArray<float>> gradients;    // dL/d activations[l], same shapes
  z2::DeviceArray<float> teacher;                   // [classes, input] fixed labelling layer
  z2::DeviceArray<int> labels;                      // [B]
  z2::DeviceArray<float> sample_loss;               // [B]
};

Model::Model(z2::Compute& compute, z2::Engine& engine, const Config& config)
    : compute_(compute), engine_(engine), config_(config), buffers_(new Buffers) {
  widths_.push_back(config.input);
  for (int l = 0; l + 1 < config.layers; ++l) widths_.push_back(config.hidden);
  widths_.push_back(config.classes);
  for (int l = 0; l < config.layers; ++l) {
    std::string name = "layer" + std::to_string(l);
    weights_.push_back(engine.add_parameter(name + ".weight", (size_t)widths_[l + 1] * widths_[l], true));
    biases_.push_back(engine.add_parameter(name + ".bias", (size_t)widths_[l + 1], false));
  }
  const size_t B = config.micro_batch;
  for (int l = 0; l <= config.layers; ++l) {
    buffers_->activations.emplace_back(compute, B * widths_[l], z2::MemoryKind::activations);
    buffers_->gradients.emplace_back(compute, B * widths_[l], z2::MemoryKind::activations);
  }
  buffers_->teacher =
      z2::DeviceArray<float>(compute, (size_t)config.classes * config.input, z2::MemoryKind::activations);
  buffers_->labels = z2::DeviceArray<int>(compute, B, z2::MemoryKind::activations);
  buffers_->sample_loss = z2::DeviceArray<float>(compute, B, z2::MemoryKind::activations);
}

Model::~Model() { delete buffers_; }

size_t Model::parameter_count() const {
  size_t total = 0;
  for (int l = 0; l < config_.layers; ++l) total += (size_t)widths_[l + 1] * widths_[l] + widths_[l + 1];
  return total;
}

void Model::initialize() {
  // Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch.nn.Linear, keyed by
  // (seed, parameter id, element).
  const uint64_t seed = config_.seed;
  for (int l = 0; l < config_.layers; ++l) {
    const float bound = 1.0f / std::sqrt((float)widths_[l]);
    for (z2::ParameterId id : {weights_[l], biases_[l]}) {
      float* values = engine_.parameter(id);
      const size_t n = engine_.parameters()[id].numel;
      compute_.for_each(n, Z2_LOOP(i, {
                          values[i] =
                              (2.0f * z2::uniform_from_hash(z2::hash_keys(seed, 1, (uint64_t)id, i)) - 1.0f) * bound;
                        }));
    }
  }
  float* teacher = buffers_->teacher.data();
  compute_.for_each(buffers_->teacher.size(),
                    Z2_LOOP(i, { teacher[i] = 2.0f * z2::uniform_from_hash(z2::hash_keys(seed, 2, i)) - 1.0f; }));
  compute_.synchronize(compute_.compute_stream());
}

float Model::micro_step(long step, int a) {
  const int B = config_.micro_batch, L = config_.layers, in = config_.input, classes = config_.classes;
  const long m = engine_.micro_batch_index(a);  // global micro-batch (notes/06)
  const uint64_t seed = config_.seed;
  Buffers& buffers = *buffers_;

  // --- data: x [B, in] keyed by (seed, step, global sample, feature) --------
  float* x = buffers.activations[0].data();
  compute_.for_each((size_t)B * in, Z2_LOOP(i, {
                      const uint64_t sample = (uint64_t)m * B + i / in;
                      x[i] =
                          2.0f * z2::uniform_from_hash(z2::hash_keys(seed, 3, (uint64_t)step, sample, i % in)) - 1.0f;
                    }));
  // Label = argmax of the teacher's scores, a row per thread.
  const float* teacher = buffers.teacher.data();
  int* labels = buffers.labels.data();
  compute_.for_each((size_t)B, Z2_LOOP(b, {
                      int best = 0;
                      float best_score = -1e30f;
                      for (int c = 0; c < classes; ++c) {
                        float score = 0.0f;
                        for (int k = 0; k < in; ++k) score += teacher[c * in + k] * x[b * in + k];
                        if (score > best_score) best_score = score, best = c;
                      }
                      labels[b] = best;
                    }));

  // --- forward: a[l+1] = act(a[l] W^T + b) ---------------------------------
  for (int l = 0; l < L; ++l) {
    const int fan_in = widths_[l], fan_out = widths_[l + 1];
    const float* input = buffers.activations[l].data();
    float* output = buffers.activations[l + 1].data();
    const float* bias = engine_.parameter(biases_[l]);
    // output [B, fan_out] = input [B, fan_in] x W^T, W [fan_out, fan_in]
    compute_.gemm(false, true, B, fan_out, fan_in, 1.0f, input, fan_in, engine_.parameter(weights_[l]), fan_in, 0.0f,
                  output, fan_out);
    const bool hidden = l + 1 < L;
    compute_.for_each((size_t)B * fan_out, Z2_LOOP(i, {
                        float z = output[i] + bias[i % fan_out];
                        output[i] = hidden ? tanhf(z) : z;
                      }));
  }

  // --- loss and its gradient: softmax cross-entropy, a row per thread -------
  // The loss of the step is the mean over all N * A * B samples, so each
  // sample's gradient is divided by that count here, before any reduction.
  const long total_samples = (long)B * engine_.options().accumulation_steps * engine_.world_size();
  const float scale = 1.0f / (float)total_samples;
  const float* logits = buffers.activations[L].data();
  float* dlogits = buffers.gradients[L].data();
  float* sample_loss = buffers.sample_loss.data();
  compute_.for_each((size_t)B, Z2_LOOP(b, {
                      const float* row = logits + b * classes;
                      float max_logit = row[0];
                      for (int c = 1; c < classes; ++c) max_logit = fmaxf(max_logit, row[c]);
                      float sum = 0.0f;
                      for (int c = 0; c < classes; ++c) sum += expf(row[c] - max_logit);
                      const float log_sum = logf(sum);
                      sample_loss[b] = log_sum + max_logit - row[labels[b]];
                      for (int c = 0; c < classes; ++c) {
                        float probability = expf(row[c] - max_logit - log_sum);
                        dlogits[b * classes + c] = (probability - (c == labels[b] ? 1.0f : 0.0f)) * scale;
                      }
                    }));

  // --- backward, last layer first, handing each gradient over at once -------
  for (int l = L - 1; l >= 0; --l) {
    const int fan_in = widths_[l], fan_out = widths_[l + 1];
    float* upstream = buffers.gradients[l + 1].data();  // dL/d output (after the activation)
    const float* output = buffers.activations[l + 1].data();
    if (l + 1 < L)  // through tanh: dz = da (1 - a^2)
      compute_.for_each((size_t)B * fan_out,
                        Z2_LOOP(i, { upstream[i] = upstream[i] * (1.0f - output[i] * output[i]); }));
    // dW [fan_out, fan_in] = dz^T [fan_out, B] x input [B, fan_in]
    float* weight_gradient = engine_.gradient_output(weights_[l]);
    compute_.gemm(true, false, fan_out, fan_in, B, 1.0f, upstream, fan_out, buffers.activations[l].data(), fan_in, 0.0f,
                  weight_gradient, fan_in);
    engine_.gradient_ready(weights_[l]);
    // db [fan_out] = sum over the batch, in order, one thread per column.
    float* bias_gradient = engine_.gradient_output(biases_[l]);
    compute_.for_each((size_t)fan_out, Z2_LOOP(j, {
                        float sum = 0.0f;
                        for (int b = 0; b < B; ++b) sum += upstream[(size_t)b * fan_out + j];
                        bias_gradient[j] = sum;
                      }));
    engine_.gradient_ready(biases_[l]);
    // d input [B, fan_in] = dz [B, fan_out] x W [fan_out, fan_in]
    if (l > 0)
      compute_.gemm(false, false, B, fan_in, fan_out, 1.0f, upstream, fan_out, engine_.parameter(weights_[l]), fan_in,
                    0.0f, buffers.gradients[l].data(), fan_in);
  }

  // --- this micro-batch's share of the loss, summed in canonical order -------
  std::vector<float> losses(B);
  compute_.copy(losses.data(), sample_loss, B * sizeof(float), compute_.compute_stream());
  compute_.synchronize(compute_.compute_stream());
  float contribution = z2::canonical_tree_sum(B, [&](long b) { return losses[b] * scale; });
  engine_.end_micro_step(contribution);
  return contribution;
}

z2::StepReport Model::train_step(long step) {
  for (int a = 0; a < engine_.options().accumulation_steps; ++a) micro_step(step, a);
  return engine_.step();
}

}  // namespace mlp
