// trainer/hf_export.h — the files other tools read: safetensors (the export,
// the batch dump and the checkpoints' rank files), the Hugging Face export
// (config.json, the weights, a byte-level tokenizer for AutoTokenizer) and
// --dump-batch (step 0's weights, batch, loss and gradients, for the
// reference checks). Apart from the model, which hands over its parameters'
// values and shapes and knows nothing of these formats; defined in
// trainer/hf_export.cpp.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/model_shape.h"
#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// A tensor's bytes are either its own (`owned`: the batch dump's token ids)
// or a view of the caller's values, which outlive the file's writing: a
// checkpoint or an export holds its values once, not a second copy per
// tensor (notes/10, "What a run holds on the host besides the plan").
struct Tensor {
  std::string name, dtype;  // "F32" or "I64"
  std::vector<long> shape;
  std::string owned;
  const char* view = nullptr;
  size_t view_bytes = 0;
  std::string_view bytes() const { return view ? std::string_view(view, view_bytes) : std::string_view(owned); }
};
inline Tensor tensor_f32(const std::string& name, std::vector<long> shape, const float* values, size_t count) {
  return {name, "F32", std::move(shape), std::string(), (const char*)values, count * sizeof(float)};
}

// safetensors: an 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and byte range, padded with spaces to a multiple
// of 8, then the raw little-endian data.
std::string safetensors_bytes(const std::vector<Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Parameters (canonical order, as Engine::parameters_to_host gives them) as
// tensors named as Hugging Face names them, each `prefix` + its name: views
// of `values`, which must outlive them.
std::vector<Tensor> named_tensors(const z2::Engine& engine, const TensorShapes& tensor_shapes,
                                  const std::vector<float>& values, const std::string& prefix = "");

// The Hugging Face layout of `values` (canonical order, as
// Engine::parameters_to_host gives them): model.safetensors, config.json,
// the tokenizer's files. `dumped`: the precision of a dump's working weights.
void export_hf(const std::string& directory, const ModelShape& shape, const TensorShapes& tensor_shapes,
               const z2::Engine& engine, const std::vector<float>& values, z2::Precision dumped = z2::Precision::fp32);

// Step 0's dump (--dump-batch), as the training step collects it.
struct BatchDump {
  std::vector<float> weights;              // the working weights forward read (16-bit: as floats)
  std::vector<int64_t> input_ids, labels;  // every micro-batch's [B, T], in order
  long rows = 0;                           // the sequences they hold
};
// Step 0, one rank: the weights, batch, loss and gradients of this step.
void write_batch_dump(const Settings& settings, const ModelShape& shape, const TensorShapes& tensor_shapes,
                      const z2::Engine& engine, const BatchDump& dump, const z2::StepReport& report,
                      const std::vector<float>& gradients);

}  // namespace bert
