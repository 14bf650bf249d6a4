// trainer/hf_import.h — what the trainer reads that other tools wrote: a
// safetensors file's tensors, and --init-hf DIR, a Hugging Face
// BertForMaskedLM directory (config.json, model.safetensors) whose weights
// a run starts from instead of the seed's initialization, so that zero2 can
// start where another implementation's run started (notes/12). The reverse
// of trainer/hf_export.h; defined in trainer/hf_import.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/model_shape.h"
#include "trainer/settings.h"

namespace bert {

// One tensor of a safetensors file: its dtype ("F32", "BF16", ...), shape
// and bytes (a view into the file's text, which outlives it).
struct TensorView {
  std::string dtype;
  std::vector<long> shape;
  const char* data = nullptr;
  size_t bytes = 0;
};
// The tensors of a safetensors file held whole in `contents` (its header
// checked: every range inside the file, sizes that match dtype x shape, no
// overlaps); `path` names it in messages. "__metadata__" is not a tensor.
std::map<std::string, TensorView> safetensors_tensors(const std::string& path, const std::string& contents);
// A tensor's elements as float32: F32 as stored, F16 and BF16 widened
// (exactly); any other dtype is refused, naming the tensor.
std::vector<float> tensor_as_floats(const std::string& path, const std::string& name, const TensorView& tensor);

// --init-hf DIR read and checked against the model the run trains.
struct InitialWeights {
  std::vector<float> values;       // every parameter, registration order (Engine::parameters_from_host)
  std::string file_bytes;          // model.safetensors as read: the ranks compare its fingerprint
  std::vector<std::string> notes;  // tensors it holds that BertForMaskedLM's MLM does not use, for the header
};
// config.json's sizes and arithmetic must be the run's (a key that differs is
// named with the flag that would match it); every parameter must be there
// with the run's shape (the first that is not is named, with both shapes).
InitialWeights read_initial_weights(const std::string& directory, const ModelShape& shape);

}  // namespace bert
