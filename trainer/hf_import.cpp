// trainer/hf_import.cpp — safetensors read, and --init-hf: a Hugging Face
// BertForMaskedLM directory as the run's initial weights (trainer/hf_import.h).
#include "trainer/hf_import.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "runtime/math.h"
#include "trainer/inputs.h"
#include "trainer/json.h"

namespace bert {

// --- safetensors, read ----------------------------------------------------------
//
// An 8-byte little-endian header length, the JSON header (each tensor's
// dtype, shape and [begin, end) of the data that follows), then the data.
// Every range is checked before a byte is read: a damaged or hand-made file
// gets a message naming what is wrong, never a read past its end.

static size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

[[noreturn]] static void unreadable(const std::string& path, const std::string& what) {
  fail("'%s' is not a safetensors file we can read: %s", path.c_str(), what.c_str());
}

std::map<std::string, TensorView> safetensors_tensors(const std::string& path, const std::string& contents) {
  auto damaged = [&](const std::string& what) { unreadable(path, what); };
  if (contents.size() < 8) damaged("it is shorter than the 8 bytes of its header's length");
  uint64_t length = 0;
  for (int k = 0; k < 8; ++k) length |= (uint64_t)(unsigned char)contents[k] << (8 * k);
  if (length > contents.size() - 8) damaged("its header's length runs past the end of the file");
  json header;
  try {
    header = parse_json(contents.substr(8, length));
  } catch (const json::exception& e) { damaged(std::string("its header is not JSON (") + e.what() + ")"); }
  if (!header.is_object()) damaged("its header is not a JSON object");
  const size_t data_start = 8 + length, data_bytes = contents.size() - data_start;
  std::map<std::string, TensorView> tensors;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      damaged(where + " lacks its dtype, shape or data_offsets");
    TensorView view;
    if (!entry["dtype"].is_string() || dtype_bytes(entry["dtype"].get<std::string>()) == 0)
      damaged(where + " has an unknown dtype " + json_text(entry["dtype"]));
    view.dtype = entry["dtype"].get<std::string>();
    size_t count = 1;
    if (!entry["shape"].is_array()) damaged(where + "'s shape is not a list");
    for (const json& d : entry["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 40)) damaged(where + " has a bad dimension");
      view.shape.push_back((long)d.get<uint64_t>());
      count *= d.get<size_t>();
      if (count > (1ull << 40)) damaged(where + " has more than 2^40 elements");
    }
    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      damaged(where + "'s data_offsets are not two byte offsets");
    const size_t begin = offsets[0].get<size_t>(), end = offsets[1].get<size_t>();
    if (begin > end || end > data_bytes) damaged(where + "'s bytes lie outside the file (cut short?)");
    if (end - begin != count * dtype_bytes(view.dtype))
      damaged(where + " holds " + std::to_string(end - begin) + " bytes, not the " +
              std::to_string(count * dtype_bytes(view.dtype)) + " its dtype and shape need");
    view.data = contents.data() + data_start + begin;
    view.bytes = end - begin;
    ranges.push_back({begin, end});
    tensors[name] = view;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k)
    if (ranges[k].first < ranges[k - 1].second) damaged("two tensors' bytes overlap");
  return tensors;
}

std::vector<float> tensor_as_floats(const std::string& path, const std::string& name, const TensorView& tensor) {
  const size_t count = tensor.bytes / std::max<size_t>(1, dtype_bytes(tensor.dtype));
  std::vector<float> values(count);
  if (tensor.dtype == "F32") {
    std::memcpy(values.data(), tensor.data, tensor.bytes);  // little-endian, as this host
  } else if (tensor.dtype == "BF16" || tensor.dtype == "F16") {
    // Every 16-bit value is a float exactly: the fp32 master starts equal to it.
    const bool bf16 = tensor.dtype == "BF16";
    for (size_t i = 0; i < count; ++i) {
      uint16_t bits;
      std::memcpy(&bits, tensor.data + 2 * i, 2);
      values[i] = bf16 ? z2::float_from_bf16_bits(bits) : z2::float_from_fp16_bits(bits);
    }
  } else {
    fail(
        "'%s': tensor '%s' is %s; the weights must be F32, F16 or BF16 (the master weights are float32, and a "
        "16-bit value widens to one exactly)",
        path.c_str(), name.c_str(), tensor.dtype.c_str());
  }
  return values;
}

// --- --init-hf: config.json ----------------------------------------------------------

static std::string shape_text(const std::vector<long>& shape) {
  std::string text = "[";
  for (size_t k = 0; k < shape.size(); ++k) text += (k ? ", " : "") + std::to_string(shape[k]);
  return text + "]";
}

// The keys of config.json that decide the model's arithmetic, each with
// BertConfig's default (what from_pretrained assumes when the key is absent)
// and what this run has. Dropout is not among them: it is a setting of the
// run (--dropout), as from_pretrained's own overrides are.
static void check_hf_config(const std::string& directory, const ModelShape& s) {
  const std::string path = directory + "/config.json";
  struct stat info;
  if (stat(path.c_str(), &info) != 0)
    fail(
        "--init-hf '%s' has no config.json: give a BertForMaskedLM directory (save_pretrained's config.json and "
        "model.safetensors)",
        directory.c_str());
  const std::string text = read_regular_file("--init-hf's config.json", path, 1 << 20);
  json config;
  try {
    config = parse_json(text);
  } catch (const json::exception& e) {
    fail("--init-hf's config.json '%s' is not valid JSON: %s", path.c_str(), e.what());
  }
  if (!config.is_object()) fail("--init-hf's config.json '%s' must hold a JSON object", path.c_str());
  if (config.contains("model_type") && config["model_type"] != "bert")
    fail("--init-hf '%s' holds a %s model (config.json's model_type); zero2 trains BertForMaskedLM (\"bert\")",
         directory.c_str(), json_text(config["model_type"]).c_str());
  struct Size {
    const char* key;
    long hf_default, run;
    const char* flag;
  };
  const Size sizes[] = {{"vocab_size", 30522, vocab_size, nullptr},
                        {"hidden_size", 768, s.hidden, "--hidden"},
                        {"num_hidden_layers", 12, s.layers, "--layers"},
                        {"num_attention_heads", 12, s.heads, "--heads"},
                        {"intermediate_size", 3072, s.intermediate, "--intermediate"},
                        {"max_position_embeddings", 512, s.max_positions, "--max-positions"},
                        {"type_vocab_size", 2, 1, nullptr}};
  for (const Size& size : sizes) {
    const json value = config.value(size.key, json(size.hf_default));
    if (value.is_number_integer() && value.get<long>() == size.run) continue;
    const std::string said = config.contains(size.key)
                                 ? "is " + json_text(value)
                                 : "is absent (BertConfig's default " + std::to_string(size.hf_default) + ")";
    if (size.flag)
      fail(
          "--init-hf '%s': config.json's %s %s, this run's %s is %ld: give %s %s (a run trains the sizes its flags "
          "give)",
          directory.c_str(), size.key, said.c_str(), size.flag, size.run, size.flag, json_text(value).c_str());
    fail("--init-hf '%s': config.json's %s %s; zero2's BERT has %ld (byte-level tokens, one token type)",
         directory.c_str(), size.key, said.c_str(), size.run);
  }
  // The arithmetic zero2's model has, and from_pretrained would build from these keys.
  struct Fixed {
    const char* key;
    json hf_default, ours;
    const char* what;
  };
  const Fixed fixed[] = {{"hidden_act", "gelu", "gelu", "GELU in its erf form"},
                         {"layer_norm_eps", 1e-12, 1e-12, "LayerNorm's epsilon 1e-12"},
                         {"position_embedding_type", "absolute", "absolute", "learned absolute positions"},
                         {"tie_word_embeddings", true, true, "the decoder tied to the word embeddings"}};
  for (const Fixed& key : fixed) {
    const json value = config.value(key.key, key.hf_default);
    if (value != key.ours)
      fail("--init-hf '%s': config.json's %s is %s; zero2's BERT has %s (%s)", directory.c_str(), key.key,
           json_text(value).c_str(), json_text(key.ours).c_str(), key.what);
  }
}

// --- --init-hf: the weights ------------------------------------------------------------

// Tensors a BertForPreTraining or an older save holds besides BertForMaskedLM's:
// from_pretrained leaves them unused, and so does the run (the header names them).
static bool unused_by_masked_lm(const std::string& name) {
  return name.rfind("bert.pooler.", 0) == 0 || name.rfind("cls.seq_relationship.", 0) == 0 ||
         name == "bert.embeddings.position_ids";
}

// Hugging Face ties the decoder to the word embeddings (and its bias to
// cls.predictions.bias): a save may hold either name of each pair, or both.
// Both must then hold the same values, or the model was not tied.
static const std::map<std::string, std::string> tied_names = {
    {"cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"},
    {"cls.predictions.decoder.bias", "cls.predictions.bias"}};

InitialWeights read_initial_weights(const std::string& directory, const ModelShape& shape) {
  struct stat info;
  if (stat(directory.c_str(), &info) != 0 || !S_ISDIR(info.st_mode))
    fail("--init-hf '%s' is not a directory (a BertForMaskedLM directory: config.json and model.safetensors)",
         directory.c_str());
  check_hf_config(directory, shape);
  const std::string path = directory + "/model.safetensors";
  if (stat(path.c_str(), &info) != 0) {
    const bool sharded = stat((path + ".index.json").c_str(), &info) == 0;
    const bool pickle = stat((directory + "/pytorch_model.bin").c_str(), &info) == 0;
    fail("--init-hf '%s' has no model.safetensors%s", directory.c_str(),
         sharded  ? " but a sharded one (model.safetensors.index.json): save it as one file (save_pretrained with "
                    "a max_shard_size above its size)"
         : pickle ? " but a pytorch_model.bin (a pickle, which this C++ program does not unpickle): save it with "
                    "model.save_pretrained(dir, safe_serialization=True)"
                  : "");
  }
  InitialWeights weights;
  weights.file_bytes = read_regular_file("--init-hf's model.safetensors", path, 16ull << 30);
  const std::map<std::string, TensorView> tensors = safetensors_tensors(path, weights.file_bytes);
  const std::vector<ParameterTensor> parameters = parameter_tensors(shape);
  std::set<std::string> used;
  for (const ParameterTensor& p : parameters) {
    auto found = tensors.find(p.name);
    std::string name = p.name;
    if (found == tensors.end())
      for (auto& [tied, to] : tied_names)
        if (to == p.name && tensors.count(tied)) found = tensors.find(tied), name = tied;
    if (found == tensors.end())
      fail("--init-hf '%s' has no tensor %s (shape %s): a BertForMaskedLM of this run's sizes has every parameter",
           path.c_str(), p.name.c_str(), shape_text(p.shape).c_str());
    if (found->second.shape != p.shape)
      fail("--init-hf '%s': %s has shape %s, this run's is %s", path.c_str(), name.c_str(),
           shape_text(found->second.shape).c_str(), shape_text(p.shape).c_str());
    const std::vector<float> values = tensor_as_floats(path, name, found->second);
    weights.values.insert(weights.values.end(), values.begin(), values.end());
    used.insert(name);
  }
  for (auto& [name, tensor] : tensors) {
    if (used.count(name)) continue;
    const auto tied = tied_names.find(name);
    if (tied != tied_names.end() && tensors.count(tied->second)) {
      const TensorView& other = tensors.at(tied->second);
      const std::vector<float> values = tensor_as_floats(path, name, tensor),
                               tied_values = tensor_as_floats(path, tied->second, other);
      if (tensor.shape != other.shape ||
          std::memcmp(values.data(), tied_values.data(), values.size() * sizeof(float)) != 0)
        fail("--init-hf '%s': %s differs from %s; zero2's decoder is tied to them (tie_word_embeddings)", path.c_str(),
             name.c_str(), tied->second.c_str());
    } else if (unused_by_masked_lm(name)) {
      weights.notes.push_back(name);
    } else {
      fail("--init-hf '%s' holds %s %s, which BertForMaskedLM has no parameter for: is it another model?", path.c_str(),
           name.c_str(), shape_text(tensor.shape).c_str());
    }
  }
  return weights;
}

}  // namespace bert
