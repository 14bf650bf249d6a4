// trainer/model_shape.h — the model as its plumbing sees it: the byte-level
// vocabulary, the shape, the activation modes, the parameters' tensor shapes,
// and the sizes the model computes from its shape. The model itself is
// train_bert_mini.cu, which defines the functions declared here (next to the
// buffers they count); the plan, the reports, the export and the checkpoints
// in trainer/ need these few facts and nothing else of it, so they compile
// once, not once per precision of the model.
// Layer: settings, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zero2.h"

namespace bert {

// Byte-level vocabulary: ids 0..255 are bytes, then four special tokens.
constexpr int vocab_size = 260;
constexpr int pad_token = 256, cls_token = 257, sep_token = 258, mask_token = 259;

struct ModelShape {
  int layers, hidden, heads, intermediate, seq, max_positions, micro_batch;
  float dropout;
  uint64_t seed;
  z2::Precision precision = z2::Precision::fp32;  // of the parameters and activations (notes/08)
  int head_dim() const { return hidden / heads; }
};

// What backward needs from forward (--activations; train_bert_mini.cu,
// "activation memory", says what each keeps).
enum class ActivationMode { keep, recompute, offload };

// Each parameter's tensor shape as Hugging Face stores it, in registration
// order (the order of Engine::parameters(), which holds the names and sizes).
using TensorShapes = std::vector<std::vector<long>>;

// Every parameter as the model registers it (registration order): its
// Hugging Face name, its tensor shape as Hugging Face stores it, and whether
// AdamW decays it (not the biases and LayerNorm weights, as Hugging Face's
// examples group them). What --init-hf reads into and a trace describes.
struct ParameterTensor {
  std::string name;
  std::vector<long> shape;
  bool decay = true;
  size_t numel() const {
    size_t count = 1;
    for (long d : shape) count *= (size_t)d;
    return count;
  }
};
std::vector<ParameterTensor> parameter_tensors(const ModelShape& shape);
// Every parameter's size (elements) in registration order, as the engine sees
// them: what the planner lays out.
std::vector<size_t> parameter_numels(const ModelShape& shape);

// `round` maps one buffer's bytes to what it takes: the identity for the
// live bytes the ledger counts, z2::block_round for the part of a block
// (arena) it occupies.
using BufferRound = size_t (*)(size_t);
inline size_t live_bytes(size_t bytes) { return bytes; }
// The device activation peak (bytes) the ledger must show, by mode and
// allocator, and the bound offload promises (notes/04, "The bound").
size_t activation_peak_bytes(const ModelShape& s, ActivationMode mode, bool arena, BufferRound round = live_bytes);
size_t offload_activation_bound(const ModelShape& s);

}  // namespace bert
