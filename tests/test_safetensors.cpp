// tests/test_safetensors.cpp — the safetensors reader (trainer/safetensors.h)
// on its regression corpus, tests/safetensors_corpus/ (made by
// make_corpus.py there, one file per way a file can be wrong):
//   1. each file, mapped as --init-hf maps it and its float tensors widened,
//      gets its verdict: accepted, or refused with a message naming the file
//      and the field (the table below);
//   2. the same bytes handed over in memory (the fuzz target's way in) get
//      the same verdict from the header and offsets alone.
// Rank-local and cheap: every rank reads the same files and agrees.
// The reader inside the trainer (--init-hf, a checkpoint's rank files) is
// tested through the command line (tests/cli/checkpoints.sh and traces.sh).
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "../trainer/safetensors.h"
#include "harness.h"

using harness::agree;

namespace {

// Beside this file, wherever the build runs from.
const std::string corpus_directory = std::filesystem::path(__FILE__).parent_path().string() + "/safetensors_corpus";

// What each corpus file must give: "" when it is accepted, else a fragment
// of the one message (which must also name the file).
struct Expected {
  const char* file;
  const char* fragment;
};
// clang-format off
const Expected verdicts[] = {
    {"valid.safetensors", ""},
    {"header_4_short.safetensors", "its tensors' data ends at byte 28 of 32: the rest belongs to no tensor (a header length"},
    {"header_1_short.safetensors", "its tensors' data ends at byte 28 of 29: the rest belongs to no tensor"},
    {"header_past_file.safetensors", "its header's length 1000 runs past the end of the file"},
    {"header_huge.safetensors", "its header's length 9223372036854775808 runs past the end of the file"},
    {"too_short.safetensors", "it has 3 bytes, fewer than the 8 of its header's length"},
    {"trailing_bytes.safetensors", "its tensors' data ends at byte 28 of 32: the rest belongs to no tensor"},
    {"hole.safetensors", "no tensor holds the data's bytes [16, 20) (before tensor 'b''s data_offsets [20, 32])"},
    {"overlap.safetensors", "tensor 'b''s data_offsets [8, 20] overlap tensor 'a''s [0, 16]"},
    {"offsets_reversed.safetensors", "tensor 'b''s data_offsets [28, 16] end before they begin"},
    {"offsets_out_of_range.safetensors", "tensor 'b''s data_offsets [16, 28] run past the data's 20 bytes"},
    {"offsets_not_two.safetensors", "tensor 'b''s data_offsets [16] are not two byte offsets"},
    {"bytes_not_shape.safetensors", "tensor 'b''s data_offsets [16, 28] hold 12 bytes, not the 16 its dtype and shape need (F32 [4])"},
    {"shape_overflow.safetensors", "tensor 'big''s shape [1099511627776,16777216] of F32 needs more than 2^64 bytes"},
    {"negative_dim.safetensors", "tensor 'a''s shape [-2,-2] has dimension 0 = -2, not a non-negative integer"},
    {"float_dim.safetensors", "tensor 'a''s shape [2.0,2] has dimension 0 = 2.0, not a non-negative integer"},
    {"unknown_dtype.safetensors", "tensor 'a' has an unknown dtype \"F33\""},
    {"no_dtype.safetensors", "tensor 'a' lacks its dtype, shape or data_offsets"},
    {"duplicate_name.safetensors", "its header has the key 'a' twice in one object"},
    {"non_object_header.safetensors", "its header is not a JSON object (it is array)"},
    {"not_json.safetensors", "its header is not JSON"},
    {"too_deep.safetensors", "its header nests objects and arrays more than 3 deep"},
    {"metadata_not_strings.safetensors", "its __metadata__ 'step' is 3, not a string"},
    {"nan_weight.safetensors", "tensor 'a' element 1 [0, 1] is nan: weights to start from must be finite"},
    {"inf_weight.safetensors", "tensor 'b' element 2 [2] is -inf: weights to start from must be finite"},
};
// clang-format on

// The file mapped and every float tensor widened, as --init-hf reads it:
// "" when accepted, else the message.
std::string file_verdict(const std::string& path) {
  try {
    const bert::SafetensorsFile file("a corpus file", path);
    for (auto& [name, tensor] : file.tensors()) bert::tensor_as_floats(path, name, tensor);
    return "";
  } catch (const z2::Error& error) { return error.what(); }
}

// The header and offsets alone, from the bytes in memory.
std::string bytes_verdict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    bert::safetensors_layout(path, bytes.data(), bytes.size());
    return "";
  } catch (const z2::Error& error) { return error.what(); }
}

}  // namespace

TEST_CASE("safetensors: each file of the regression corpus is accepted, or refused naming the file and the field") {
  std::string failures;
  std::set<std::string> listed;
  for (const Expected& expected : verdicts) {
    const std::string path = corpus_directory + "/" + expected.file;
    listed.insert(expected.file);
    const std::string got = file_verdict(path);
    const bool right = *expected.fragment == '\0'
                           ? got.empty()
                           : got.find(expected.fragment) != std::string::npos && got.find(path) != std::string::npos;
    if (!right) failures += std::string("\n  ") + expected.file + ": got '" + got + "'";
  }
  // A file added to the corpus without its line here would go untested.
  for (const auto& entry : std::filesystem::directory_iterator(corpus_directory))
    if (entry.path().extension() == ".safetensors" && !listed.count(entry.path().filename().string()))
      failures += "\n  " + entry.path().filename().string() + " has no expected verdict in the table";
  CHECK(agree(failures.empty(), "safetensors corpus:" + failures));
}

TEST_CASE("safetensors: the bytes in memory (the fuzz target's way in) get the mapped file's verdict") {
  std::string failures;
  for (const Expected& expected : verdicts) {
    const std::string path = corpus_directory + "/" + expected.file;
    const std::string from_file = file_verdict(path), from_bytes = bytes_verdict(path);
    // A NaN or an infinity is a value, not the layout: the bytes' verdict accepts those two.
    const bool values_only = from_file.find("must be finite") != std::string::npos;
    if (from_bytes != (values_only ? "" : from_file))
      failures += std::string("\n  ") + expected.file + ": in memory '" + from_bytes + "', mapped '" + from_file + "'";
  }
  CHECK(agree(failures.empty(), "safetensors in memory:" + failures));
}
