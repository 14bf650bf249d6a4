// trainer/hf_import.cpp — --init-hf: a Hugging Face BertForMaskedLM
// directory as the run's initial weights (trainer/hf_import.h); its
// model.safetensors read by trainer/safetensors.cpp.
#include "trainer/hf_import.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>

#include "trainer/inputs.h"
#include "trainer/json.h"
#include "trainer/safetensors.h"

namespace bert {

// --- --init-hf: config.json ----------------------------------------------------------

static std::string shape_text(const std::vector<long>& shape) {
  std::string text = "[";
  for (size_t k = 0; k < shape.size(); ++k) text += (k ? ", " : "") + std::to_string(shape[k]);
  return text + "]";
}

// A file of the directory that should be there: false when it is not (the
// caller says what to give instead); a dangling link or a link loop under
// that name is refused as what it is.
static bool file_is_there(const std::string& what, const std::string& path) {
  struct stat info;
  if (stat(path.c_str(), &info) == 0) return true;
  const int error = errno;
  if (!path_is_there(path)) return false;
  fail("%s '%s' cannot be read: %s%s", what.c_str(), path.c_str(), std::strerror(error), stat_hint(error));
}

// How deep config.json may nest: save_pretrained's goes 2 deep (id2label);
// the JSON library recurses, so deeper is refused before it parses.
constexpr int max_hf_config_depth = 16;

// config.json as a JSON object, and the text of each number in it as
// written (a message quotes 64.0, not 64; -0, not 0).
static json hf_config_object(const std::string& directory, NumberTexts& numbers) {
  const std::string path = directory + "/config.json";
  if (!file_is_there("--init-hf's config.json", path))
    fail(
        "--init-hf '%s' has no config.json: give a BertForMaskedLM directory (save_pretrained's config.json and "
        "model.safetensors)",
        directory.c_str());
  const std::string text = read_regular_file("--init-hf's config.json", path, 1 << 20);
  const size_t deep = first_nesting_beyond(text, max_hf_config_depth);
  if (deep != std::string::npos)
    fail("--init-hf's config.json '%s' nests objects and arrays more than %d deep (at offset %zu)", path.c_str(),
         max_hf_config_depth, deep);
  json config;
  try {
    config = parse_json(text);
  } catch (const json::exception& e) {
    fail("--init-hf's config.json '%s' is not valid JSON: %s", path.c_str(), e.what());
  }
  if (!config.is_object()) fail("--init-hf's config.json '%s' must hold a JSON object", path.c_str());
  numbers = number_texts(text);  // valid JSON by now
  return config;
}

// The keys of config.json that decide the model's sizes, each with
// BertConfig's default (what from_pretrained assumes when the key is absent)
// and what this run has. A value is quoted as written; the advice to give a
// flag comes only with a value that flag takes (a positive integer in its
// range), so the advice itself always works.
static void check_hf_sizes(const std::string& directory, const json& config, const NumberTexts& numbers,
                           const ModelShape& s) {
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
    // (The default as unsigned, as the parser reads a positive integer: an
    // absent key is then "absent", never "not a positive integer".)
    const json value = config.value(size.key, json((uint64_t)size.hf_default));
    if (value.is_number_integer() && value.get<long>() == size.run) continue;
    const auto written = numbers.texts.find(size.key);
    const std::string text =
        value.is_number() && written != numbers.texts.end() ? written->second : json_text(value).substr(0, 80);
    const std::string ours = size.flag ? "this run's " + std::string(size.flag) + " is " + std::to_string(size.run)
                                       : "zero2's BERT has " + std::to_string(size.run);
    if (!(value.is_number_unsigned() && value.get<uint64_t>() > 0))
      fail("--init-hf '%s': config.json's %s is %s, not a positive integer (BertConfig's sizes are ints); %s",
           directory.c_str(), size.key, text.c_str(), ours.c_str());
    const std::string said = config.contains(size.key)
                                 ? "is " + text
                                 : "is absent (BertConfig's default " + std::to_string(size.hf_default) + ")";
    if (!size.flag)
      fail("--init-hf '%s': config.json's %s %s; zero2's BERT has %ld (byte-level tokens, one token type)",
           directory.c_str(), size.key, said.c_str(), size.run);
    std::string advice;
    try {  // the flag's own check says whether it takes this value
      Settings scratch;
      apply(scratch, size.flag, text);
      advice = std::string(": give ") + size.flag + " " + text + " (a run trains the sizes its flags give)";
    } catch (const z2::Error&) { advice = std::string(" (and ") + text + " is beyond what " + size.flag + " takes)"; }
    fail("--init-hf '%s': config.json's %s %s, this run's %s is %ld%s", directory.c_str(), size.key, said.c_str(),
         size.flag, size.run, advice.c_str());
  }
}

// The arithmetic zero2's model has, and from_pretrained would build from
// these keys. Dropout is not among them: it is a setting of the run
// (--dropout), as from_pretrained's own overrides are.
static void check_hf_arithmetic(const std::string& directory, const json& config) {
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

// config.json's model type, sizes and arithmetic must be this run's.
static void check_hf_config(const std::string& directory, const ModelShape& s) {
  NumberTexts numbers;
  const json config = hf_config_object(directory, numbers);
  if (config.contains("model_type") && config["model_type"] != "bert")
    fail("--init-hf '%s' holds a %s model (config.json's model_type); zero2 trains BertForMaskedLM (\"bert\")",
         directory.c_str(), json_text(config["model_type"]).c_str());
  check_hf_sizes(directory, config, numbers, s);
  check_hf_arithmetic(directory, config);
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

// model.safetensors' path, or why the directory has none (a sharded save,
// a pickle: each with what to do instead).
static std::string weights_path(const std::string& directory) {
  const std::string path = directory + "/model.safetensors";
  if (file_is_there("--init-hf's model.safetensors", path)) return path;
  const bool sharded = path_is_there(path + ".index.json");
  const bool pickle = path_is_there(directory + "/pytorch_model.bin");
  fail("--init-hf '%s' has no model.safetensors%s", directory.c_str(),
       sharded  ? " but a sharded one (model.safetensors.index.json): save it as one file (save_pretrained with "
                  "a max_shard_size above its size)"
       : pickle ? " but a pytorch_model.bin (a pickle, which this C++ program does not unpickle): save it with "
                  "model.save_pretrained(dir, safe_serialization=True)"
                : "");
}

// The tensors the run does not take as parameters: a tied name must hold
// its partner's values; a pre-training head is noted; anything else is
// another model's, refused.
static void check_unused_tensors(const SafetensorsFile& file, const std::set<std::string>& used,
                                 std::vector<std::string>& notes) {
  const std::map<std::string, TensorView>& tensors = file.tensors();
  const std::string& path = file.path();
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
      notes.push_back(name);
    } else {
      fail("--init-hf '%s' holds %s %s, which BertForMaskedLM has no parameter for: is it another model?", path.c_str(),
           name.c_str(), shape_text(tensor.shape).c_str());
    }
  }
}

InitialWeights read_initial_weights(const std::string& directory, const ModelShape& shape) {
  struct stat info;
  if (stat(directory.c_str(), &info) != 0 || !S_ISDIR(info.st_mode))
    fail("--init-hf '%s' is not a directory (a BertForMaskedLM directory: config.json and model.safetensors)",
         directory.c_str());
  check_hf_config(directory, shape);
  // Mapped, not read: the file's pages, hashed once for the ranks' comparison, then each parameter widened.
  const SafetensorsFile file("--init-hf's model.safetensors", weights_path(directory));
  const std::string& path = file.path();
  InitialWeights weights;
  Sha256 sha;
  sha.update(file.bytes(), file.size());
  weights.fingerprint = {sha.hex(), file.size()};
  const std::map<std::string, TensorView>& tensors = file.tensors();
  const std::vector<ParameterTensor> parameters = parameter_tensors(shape);
  size_t psi = 0;
  for (const ParameterTensor& p : parameters) psi += p.numel();
  weights.values.reserve(psi);  // once: growing by doubling would hold two copies at a time
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
  check_unused_tensors(file, used, weights.notes);
  return weights;
}

}  // namespace bert
