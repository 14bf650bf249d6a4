// trainer/hf_import.h — what the trainer reads that other tools wrote:
// --init-hf DIR, a Hugging Face BertForMaskedLM directory (config.json,
// model.safetensors) whose weights a run starts from instead of the seed's
// initialization, so that zero2 can start where another implementation's
// run started (notes/12). The reverse of trainer/hf_export.h; defined in
// trainer/hf_import.cpp. The safetensors file itself is read by
// trainer/safetensors.h.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/inputs.h"
#include "trainer/model_shape.h"
#include "trainer/settings.h"

namespace bert {

// --init-hf DIR read and checked against the model the run trains.
struct InitialWeights {
  std::vector<float> values;       // every parameter, registration order (Engine::parameters_from_host)
  FileFingerprint fingerprint;     // model.safetensors' SHA-256 and size: the ranks compare them
  std::vector<std::string> notes;  // tensors it holds that BertForMaskedLM's MLM does not use, for the header
};
// config.json's sizes and arithmetic must be the run's (a key that differs is
// named with the flag that would match it); every parameter must be there
// with the run's shape (the first that is not is named, with both shapes),
// finite; model.safetensors is read as trainer/safetensors.h says.
InitialWeights read_initial_weights(const std::string& directory, const ModelShape& shape);

// What --init-hf holds on the host: at its peak (inside
// read_initial_weights) model.safetensors mapped (every page touched by its
// SHA-256; unmapped before it returns), the values (4 bytes x Psi, reserved
// once) and at most two tensors widened to float32 at once (the tied
// decoder compared with the word embeddings); afterwards the values alone,
// until the engine has them (Training's constructor frees them right after
// Engine::parameters_from_host). It is read before the memory check, which
// measures what the process holds then, the values included (notes/10).

}  // namespace bert
