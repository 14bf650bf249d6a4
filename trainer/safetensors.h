// trainer/safetensors.h — the one safetensors reader: a file another tool
// wrote (--init-hf's model.safetensors, trainer/hf_import.cpp) or a
// checkpoint's rank file (trainer/checkpoints.cpp), read as untrusted input.
// Defined in trainer/safetensors.cpp; the writer is trainer/hf_export.h's.
//
// The format: an 8-byte little-endian header length, the header (a JSON
// object: each tensor's dtype, shape and data_offsets [begin, end) in the
// data section, and an optional "__metadata__" of strings), then the data.
// Everything the header says is checked before a byte of data is read, and
// nothing is allocated for a size the file only claims:
//   - the header's length against the file's size (and at most 100 MB);
//   - the header's nesting (3 deep at most) before the JSON library parses it,
//     each key once (the library would keep the last of two tensors);
//   - each tensor: a known dtype, a shape of non-negative integers whose
//     element count x dtype size does not overflow and equals end - begin;
//   - the ranges, sorted, start at 0, abut and end at the file's end: no
//     overlap, no hole, no trailing bytes. A header length a few bytes short
//     still parses (its padding spaces keep the JSON valid) and would shift
//     every tensor; this catches it.
// A refusal names the file and the field, in one sentence.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace bert {

class InputFile;  // trainer/inputs.h

// The largest header read: 100,000,000 bytes, the bound the safetensors
// library itself reads and writes with (a file past it is not one its own
// readers take), and enough for a million tensors' entries.
constexpr size_t max_safetensors_header = 100000000;
// The largest file the trainer maps: 16 GiB (a BERT-large's float32 weights
// are 1.3 GB; past this a path is more likely a mistake than a model).
constexpr size_t max_safetensors_file = 16ull << 30;

// Bytes per element of a safetensors dtype ("F32": 4), or 0 when unknown.
size_t dtype_bytes(const std::string& dtype);

// One tensor as its header entry says, checked: its bytes are
// [begin, end) of the data section (which starts at data_start in the file).
struct TensorEntry {
  std::string dtype;
  std::vector<long> shape;
  size_t begin = 0, end = 0;
};
// A header, checked against the file it came from.
struct SafetensorsLayout {
  size_t data_start = 0;                        // 8 + the header's length
  std::map<std::string, TensorEntry> tensors;   // by name ("__metadata__" is not a tensor)
  std::map<std::string, std::string> metadata;  // "__metadata__", when there is one
};

// The header's length from the file's first 8 bytes, checked against the
// file's size and `max_header` before anything is allocated for it. `path`
// names the file in messages.
size_t safetensors_header_length(const std::string& path, const unsigned char first8[8], uint64_t file_size,
                                 size_t max_header = max_safetensors_header);
// The header's `length` bytes of JSON (from safetensors_header_length),
// parsed and checked as this file's opening comment says, for a file of
// `file_size` bytes.
SafetensorsLayout parse_safetensors_header(const std::string& path, const char* header, size_t length,
                                           uint64_t file_size);
// A whole file's bytes in memory (a mapped file, a fuzzer's input): both of
// the above. Reads nothing outside [bytes, bytes + size).
SafetensorsLayout safetensors_layout(const std::string& path, const char* bytes, size_t size);
// An opened file's header, read with pread (nothing else of the file is
// read): both of the above, the header at most `max_header` bytes.
SafetensorsLayout safetensors_layout(const std::string& path, const InputFile& file,
                                     size_t max_header = max_safetensors_header);

// One tensor's bytes inside a mapped file (valid while the file is).
struct TensorView {
  std::string dtype;
  std::vector<long> shape;
  const char* data = nullptr;
  size_t bytes = 0;
};

// A safetensors file mapped read-only (mmap, PROT_READ, MAP_PRIVATE): opened
// once as an InputFile (a regular file of at most `max_bytes`), its layout
// checked, never copied. What it holds on the host: the mapping, file_size
// bytes of the page cache, resident as pages are touched (hashing it touches
// them all) and shared with other readers of the file; freed when it goes.
// A file cut short by another process while mapped would end the run with
// SIGBUS at the missing page: an input is not changed under a run.
class SafetensorsFile {
 public:
  SafetensorsFile(const std::string& what, const std::string& path, size_t max_bytes = max_safetensors_file);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // The whole file as mapped, for its fingerprint.
  const char* bytes() const { return bytes_; }
  size_t size() const { return size_; }

 private:
  std::string path_;
  const char* bytes_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// A tensor's elements as float32: F32 as stored, F16 and BF16 widened
// (exactly); any other dtype is refused, naming the tensor. Every element
// must be finite: the first NaN or infinity is refused with its index and
// value (weights to train from; a NaN would only show as a NaN loss later).
std::vector<float> tensor_as_floats(const std::string& path, const std::string& name, const TensorView& tensor);

}  // namespace bert
