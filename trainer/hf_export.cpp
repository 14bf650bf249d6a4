// trainer/hf_export.cpp — safetensors, the Hugging Face export and its
// tokenizer, and the batch dump (trainer/hf_export.h).
#include "trainer/hf_export.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "trainer/json.h"
#include "trainer/output_files.h"

namespace bert {

std::string safetensors_bytes(const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  size_t offset = 0;
  for (auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes().size()}}};
    offset += t.bytes().size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = json_text(header);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string contents(8, '\0');
  // Its final size up front: growing by doubling would hold the old and the
  // new buffer at once, up to twice the file's bytes on the host.
  contents.reserve(8 + text.size() + offset);
  uint64_t length = text.size();
  for (int k = 0; k < 8; ++k) contents[k] = (char)((length >> (8 * k)) & 0xff);
  contents += text;
  for (auto& t : tensors) contents += t.bytes();
  return contents;
}
static void write_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  write_output_file(path, safetensors_bytes(tensors, metadata));
}

// A float setting as the decimal the user typed (0.1, not 0.100000001).
static double decimal(float value) {
  char text[32];
  snprintf(text, sizeof text, "%.7g", value);
  return std::strtod(text, nullptr);
}

// config.json in Hugging Face's BertConfig keys, so BertForMaskedLM.from_pretrained loads the export.
static json hf_config(const ModelShape& s) {
  return {{"architectures", {"BertForMaskedLM"}},
          {"model_type", "bert"},
          {"vocab_size", vocab_size},
          {"hidden_size", s.hidden},
          {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads},
          {"intermediate_size", s.intermediate},
          {"hidden_act", "gelu"},
          {"hidden_dropout_prob", decimal(s.dropout)},
          {"attention_probs_dropout_prob", decimal(s.dropout)},
          {"max_position_embeddings", s.max_positions},
          {"type_vocab_size", 1},
          {"initializer_range", 0.02},
          {"layer_norm_eps", 1e-12},
          {"pad_token_id", pad_token},
          {"position_embedding_type", "absolute"},
          {"tie_word_embeddings", true},
          {"torch_dtype", "float32"}};
}

// The byte-level tokenizer the trainer's ids come from, in the files Hugging
// Face's AutoTokenizer reads: token b is byte b (0..255), then [PAD] [CLS]
// [SEP] [MASK] = 256..259, and a text becomes [CLS] its bytes [SEP]. In the
// tokenizers library's terms: the ByteLevel pre-tokenizer without its regex
// (one piece per text) maps each byte to GPT-2's printable stand-in for it,
// a BPE model with no merges maps each stand-in to its byte's id, and a
// template adds [CLS] and [SEP]; the ByteLevel decoder maps back.
static std::string byte_stand_in(int byte) {  // GPT-2's bytes_to_unicode, as UTF-8
  int code = byte;
  const bool printable =
      (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
  if (!printable) {  // the others, in byte order, from U+0100 on
    int before = 0;
    for (int b = 0; b < byte; ++b)
      before += !((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF));
    code = 256 + before;
  }
  std::string utf8;
  if (code < 0x80) utf8 += (char)code;
  else utf8 += (char)(0xC0 | (code >> 6)), utf8 += (char)(0x80 | (code & 0x3F));  // code < 0x800
  return utf8;
}
static json hf_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_stand_in(b)] = b;
  // The specials in the vocabulary too (not only as added tokens), so the
  // tokenizer says nothing about "special tokens added to the vocabulary".
  for (const auto& [name, id] : {std::pair<const char*, int>{"[PAD]", pad_token},
                                 {"[CLS]", cls_token},
                                 {"[SEP]", sep_token},
                                 {"[MASK]", mask_token}})
    vocab[name] = id;
  json added = json::array();
  const char* specials[] = {"[PAD]", "[CLS]", "[SEP]", "[MASK]"};
  for (int k = 0; k < 4; ++k)
    added.push_back({{"id", pad_token + k},
                     {"content", specials[k]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  auto special = [](const char* name) { return json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}}; };
  auto sequence = [](const char* name) {
    return json{{"Sequence", {{"id", name}, {"type_id", 0}}}};
  };  // one token type
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  json tokenizer = {{"version", "1.0"},
                    {"truncation", nullptr},
                    {"padding", nullptr},
                    {"added_tokens", added},
                    {"normalizer", nullptr},
                    {"pre_tokenizer", byte_level},
                    {"post_processor",
                     {{"type", "TemplateProcessing"},
                      {"single", {special("[CLS]"), sequence("A"), special("[SEP]")}},
                      {"pair", {special("[CLS]"), sequence("A"), special("[SEP]"), sequence("B"), special("[SEP]")}},
                      {"special_tokens",
                       {{"[CLS]", {{"id", "[CLS]"}, {"ids", {cls_token}}, {"tokens", {"[CLS]"}}}},
                        {"[SEP]", {{"id", "[SEP]"}, {"ids", {sep_token}}, {"tokens", {"[SEP]"}}}}}}}},
                    {"decoder", byte_level},
                    {"model",
                     {{"type", "BPE"},
                      {"dropout", nullptr},
                      {"unk_token", nullptr},
                      {"continuing_subword_prefix", nullptr},
                      {"end_of_word_suffix", nullptr},
                      {"fuse_unk", false},
                      {"byte_fallback", false},
                      {"vocab", vocab},
                      {"merges", json::array()}}}};
  return tokenizer;
}
static json hf_special_tokens() {
  return {{"pad_token", "[PAD]"}, {"cls_token", "[CLS]"}, {"sep_token", "[SEP]"}, {"mask_token", "[MASK]"}};
}
static json hf_tokenizer_config(int max_positions) {
  json config = hf_special_tokens();
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["model_max_length"] = max_positions;
  config["clean_up_tokenization_spaces"] = false;
  return config;
}

// The decoder weight is not stored: it is the word embedding (Hugging Face
// ties it again on load).
std::vector<Tensor> named_tensors(const z2::Engine& engine, const TensorShapes& tensor_shapes,
                                  const std::vector<float>& values, const std::string& prefix) {
  std::vector<Tensor> tensors;
  size_t position = 0;
  const auto& infos = engine.parameters();
  for (size_t id = 0; id < infos.size(); ++id) {
    tensors.push_back(
        tensor_f32(prefix + infos[id].name, tensor_shapes[id], values.data() + position, infos[id].numel));
    position += infos[id].numel;
  }
  return tensors;
}

// A dump in mixed precision says in config.json what its float32 values are
// ("zero2_weights") and their precision ("zero2_precision"): the 16-bit
// working weights that step used. (Hugging Face ignores keys it does not know.)
void export_hf(const std::string& directory, const ModelShape& shape, const TensorShapes& tensor_shapes,
               const z2::Engine& engine, const std::vector<float>& values, z2::Precision dumped) {
  // The weights first, the config last: a directory with a config.json is
  // complete (each file itself is written atomically). An old config.json
  // from an earlier export goes first, so it cannot vouch for new weights;
  // the lock keeps another export into this directory from interleaving.
  DirectoryLock lock(directory, DirectoryLock::OnBusy::wait);
  // (A config.json that is a symlink: its target is what goes and comes back.)
  const std::string config_path = output_destination("--export-hf's config.json", directory + "/config.json");
  if (unlink(config_path.c_str()) != 0 && errno != ENOENT)
    fail("cannot replace '%s': %s", config_path.c_str(), std::strerror(errno));
  write_safetensors(directory + "/model.safetensors", named_tensors(engine, tensor_shapes, values), {{"format", "pt"}});
  const int positions = shape.max_positions;
  write_output_file(directory + "/tokenizer.json", json_text(hf_tokenizer(), 2) + "\n");
  write_output_file(directory + "/tokenizer_config.json", json_text(hf_tokenizer_config(positions), 2) + "\n");
  write_output_file(directory + "/special_tokens_map.json", json_text(hf_special_tokens(), 2) + "\n");
  json config = hf_config(shape);
  if (dumped != z2::Precision::fp32) {
    config["zero2_precision"] = z2::to_string(dumped);
    config["zero2_weights"] =
        std::string("the ") + z2::to_string(dumped) + " working weights of the dumped step, as float32";
  }
  write_output_file(config_path, json_text(config, 2) + "\n");
}

void write_batch_dump(const Settings& settings, const ModelShape& shape, const TensorShapes& tensor_shapes,
                      const z2::Engine& engine, const BatchDump& dump, const z2::StepReport& report,
                      const std::vector<float>& gradients) {
  const int T = settings.seq;
  std::vector<Tensor> tensors = named_tensors(engine, tensor_shapes, gradients, "grad.");
  const std::vector<int64_t>&ids = dump.input_ids, &labels = dump.labels;
  tensors.push_back({"input_ids", "I64", {dump.rows, T}, std::string((const char*)ids.data(), ids.size() * 8)});
  tensors.push_back({"labels", "I64", {dump.rows, T}, std::string((const char*)labels.data(), labels.size() * 8)});
  tensors.push_back(tensor_f32("loss", {}, &report.loss, 1));
  char text[7][40];
  // The update's own betas (a scheduler may set them per step: OneCycle's), as its lr.
  const double values[] = {report.lr,     report.beta1,  report.beta2, settings.eps, settings.weight_decay,
                           settings.clip, settings.dropout};
  for (int k = 0; k < 7; ++k) snprintf(text[k], sizeof text[k], "%.17g", values[k]);
  write_safetensors(settings.dump_dir + "/batch.safetensors", tensors,
                    {{"format", "pt"},
                     {"lr", text[0]},
                     {"beta1", text[1]},
                     {"beta2", text[2]},
                     {"eps", text[3]},
                     {"weight_decay", text[4]},
                     {"clip", text[5]},
                     {"dropout", text[6]}});
  export_hf(settings.dump_dir, shape, tensor_shapes, engine, dump.weights, engine.precision());
}

}  // namespace bert
