// trainer/safetensors.cpp — safetensors read as untrusted input
// (trainer/safetensors.h says what is checked, and why each check exists).
// The header is parsed from bytes in memory, so the same code serves a
// mapped file, a checkpoint's header read with pread, and the fuzz target
// (tests/fuzz_safetensors.cpp), which feeds it arbitrary bytes.
#include "trainer/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>

#include "trainer/inputs.h"
#include "trainer/json.h"
#include "trainer/settings.h"
#include "zero2.h"  // z2::float_from_bf16_bits and z2::float_from_fp16_bits (runtime/math.h), with_commas

namespace bert {

// The deepest a header nests: the header object, a tensor's entry, its
// shape (or data_offsets) list. Anything deeper is not a safetensors header,
// and is refused before the JSON library (which recurses) sees it.
constexpr int max_header_depth = 3;

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

[[noreturn]] static void unreadable(const std::string& path, const std::string& what) {
  fail("'%s' is not a safetensors file we can read: %s", path.c_str(), what.c_str());
}

// A name or value as messages show it: the header may hold a name of a
// megabyte, which would bury the sentence around it.
static std::string shown(const std::string& text) { return text.size() <= 120 ? text : text.substr(0, 120) + "..."; }
static std::string tensor_named(const std::string& name) { return "tensor '" + shown(name) + "'"; }
static std::string range_text(size_t begin, size_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// --- the header's length ----------------------------------------------------------

size_t safetensors_header_length(const std::string& path, const unsigned char first8[8], uint64_t file_size,
                                 size_t max_header) {
  uint64_t length = 0;
  for (int k = 0; k < 8; ++k) length |= (uint64_t)first8[k] << (8 * k);
  // Compared with what the file has after the 8 bytes, never as 8 + length
  // (which a length near 2^64 would wrap around).
  if (length > file_size - 8)
    unreadable(path, "its header's length " + std::to_string(length) + " runs past the end of the file (" +
                         std::to_string(file_size - 8) + " bytes follow the length: cut short, or not safetensors)");
  if (length > max_header)
    unreadable(path, "its header's length " + z2::with_commas(length) + " is more than the " +
                         z2::with_commas(max_header) + " bytes a safetensors header may have");
  return (size_t)length;
}

// --- the header's JSON ------------------------------------------------------------------

// The header's text as a JSON object: nested at most max_header_depth deep
// (counted on the text first) and each key once in every object.
static json header_object(const std::string& path, const std::string& text) {
  const size_t deep = first_nesting_beyond(text, max_header_depth);
  if (deep != std::string::npos)
    unreadable(path, "its header nests objects and arrays more than " + std::to_string(max_header_depth) +
                         " deep (at byte " + std::to_string(deep) + " of the header)");
  auto twice = [&](const std::string& key) {
    unreadable(path, "its header has the key '" + shown(key) +
                         "' twice in one object (a JSON reader keeps the last, silently: two tensors of one name?)");
  };
  json header;
  try {
    header = parse_json_keys_once(text, twice);
  } catch (const json::exception& e) { unreadable(path, std::string("its header is not JSON (") + e.what() + ")"); }
  if (!header.is_object())
    unreadable(path, "its header is not a JSON object (it is " + std::string(header.type_name()) + ")");
  return header;
}

// "__metadata__": an object of strings (the format's only free-form part).
static std::map<std::string, std::string> header_metadata(const std::string& path, const json& value) {
  if (!value.is_object())
    unreadable(path, "its __metadata__ is not an object of strings (it is " + std::string(value.type_name()) + ")");
  std::map<std::string, std::string> metadata;
  for (auto& [key, text] : value.items()) {
    if (!text.is_string())
      unreadable(path, "its __metadata__ '" + shown(key) + "' is " + shown(json_text(text)) + ", not a string");
    metadata[key] = text.get<std::string>();
  }
  return metadata;
}

// One tensor's entry: a known dtype, its shape's element count times the
// dtype's size (overflow-checked) equal to its data_offsets' length, and
// the offsets inside the data section (`data_bytes` long).
static TensorEntry tensor_entry(const std::string& path, const std::string& name, const json& entry,
                                size_t data_bytes) {
  const std::string where = tensor_named(name);
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
    unreadable(path, where + " lacks its dtype, shape or data_offsets");
  TensorEntry tensor;
  const json& dtype = entry["dtype"];
  if (!dtype.is_string() || dtype_bytes(dtype.get<std::string>()) == 0)
    unreadable(path, where + " has an unknown dtype " + shown(json_text(dtype)));
  tensor.dtype = dtype.get<std::string>();
  const json& shape = entry["shape"];
  if (!shape.is_array()) unreadable(path, where + "'s shape " + shown(json_text(shape)) + " is not a list");
  // The byte count, multiplied out in 64 bits with each step checked: a
  // shape [2^40, 2^24] would wrap to 0 and pass as an empty tensor.
  uint64_t bytes = dtype_bytes(tensor.dtype);
  for (size_t k = 0; k < shape.size(); ++k) {
    const json& d = shape[k];
    // Held as long (the model's shapes): a dimension past 2^63 - 1 cannot be one.
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t)LONG_MAX)
      unreadable(path, where + "'s shape " + shown(json_text(shape)) + " has dimension " + std::to_string(k) + " = " +
                           shown(json_text(d)) + ", not a non-negative integer");
    tensor.shape.push_back((long)d.get<uint64_t>());
    if (__builtin_mul_overflow(bytes, d.get<uint64_t>(), &bytes))
      unreadable(path,
                 where + "'s shape " + shown(json_text(shape)) + " of " + tensor.dtype + " needs more than 2^64 bytes");
  }
  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    unreadable(path, where + "'s data_offsets " + shown(json_text(offsets)) +
                         " are not two byte offsets (non-negative integers)");
  tensor.begin = offsets[0].get<uint64_t>(), tensor.end = offsets[1].get<uint64_t>();
  const std::string range = where + "'s data_offsets " + range_text(tensor.begin, tensor.end);
  if (tensor.begin > tensor.end) unreadable(path, range + " end before they begin");
  if (tensor.end > data_bytes)
    unreadable(path, range + " run past the data's " + std::to_string(data_bytes) + " bytes (cut short?)");
  if (tensor.end - tensor.begin != bytes)
    unreadable(path, range + " hold " + std::to_string(tensor.end - tensor.begin) + " bytes, not the " +
                         std::to_string(bytes) + " its dtype and shape need (" + tensor.dtype + " " +
                         shown(json_text(shape)) + ")");
  return tensor;
}

// The tensors' ranges, sorted, tile the data section: the first begins at
// 0, each begins where the one before ends, the last ends at the file's end.
static void check_coverage(const std::string& path, const std::map<std::string, TensorEntry>& tensors,
                           size_t data_bytes) {
  std::vector<std::pair<std::pair<size_t, size_t>, const std::string*>> ranges;
  for (auto& [name, tensor] : tensors) ranges.push_back({{tensor.begin, tensor.end}, &name});
  // By begin, end, then name: two tensors of one range are named in the same order on every rank.
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : *a.second < *b.second;
  });
  size_t covered = 0;  // where the ranges so far end
  for (size_t k = 0; k < ranges.size(); ++k) {
    const auto [begin, end] = ranges[k].first;
    const std::string range = tensor_named(*ranges[k].second) + "'s data_offsets " + range_text(begin, end);
    if (k > 0 && begin < covered)
      unreadable(path, range + " overlap " + tensor_named(*ranges[k - 1].second) + "'s " +
                           range_text(ranges[k - 1].first.first, ranges[k - 1].first.second));
    if (begin > covered)
      unreadable(path, "no tensor holds the data's bytes [" + std::to_string(covered) + ", " + std::to_string(begin) +
                           ") (before " + range + "): every byte of the data belongs to one tensor");
    covered = end;
  }
  if (covered != data_bytes)
    unreadable(path, "its tensors' data ends at byte " + std::to_string(covered) + " of " + std::to_string(data_bytes) +
                         ": the rest belongs to no tensor (a header length a few bytes short still parses, its "
                         "padding spaces keeping the JSON valid, and shifts every tensor; or bytes were appended)");
}

SafetensorsLayout parse_safetensors_header(const std::string& path, const char* header, size_t length,
                                           uint64_t file_size) {
  if (file_size < 8 || length > file_size - 8)  // a caller that skipped safetensors_header_length
    unreadable(path, "its header's length " + std::to_string(length) + " runs past the end of the file");
  const json object = header_object(path, std::string(header, length));
  SafetensorsLayout layout;
  layout.data_start = 8 + length;
  const size_t data_bytes = (size_t)(file_size - layout.data_start);
  for (auto& [name, entry] : object.items()) {
    if (name == "__metadata__") layout.metadata = header_metadata(path, entry);
    else layout.tensors[name] = tensor_entry(path, name, entry, data_bytes);
  }
  check_coverage(path, layout.tensors, data_bytes);
  return layout;
}

SafetensorsLayout safetensors_layout(const std::string& path, const char* bytes, size_t size) {
  if (size < 8) unreadable(path, "it has " + std::to_string(size) + " bytes, fewer than the 8 of its header's length");
  const size_t length = safetensors_header_length(path, (const unsigned char*)bytes, size);
  return parse_safetensors_header(path, bytes + 8, length, size);
}

// --- a file, mapped ----------------------------------------------------------------------

SafetensorsLayout safetensors_layout(const std::string& path, const InputFile& file, size_t max_header) {
  if (file.size() < 8)  // (and mmap refuses a length of 0)
    unreadable(path, "it has " + std::to_string(file.size()) + " bytes, fewer than the 8 of its header's length");
  unsigned char first8[8];
  file.read_at(first8, 8, 0);
  const size_t length = safetensors_header_length(path, first8, file.size(), max_header);
  std::string header(length, '\0');
  file.read_at(header.data(), length, 8);
  return parse_safetensors_header(path, header.data(), length, file.size());
}

SafetensorsFile::SafetensorsFile(const std::string& what, const std::string& path, size_t max_bytes) : path_(path) {
  const InputFile file(what, path, max_bytes);
  size_ = file.size();
  // The header is read (pread) and checked against the file's size before
  // the file is mapped: a file that is no safetensors file (4 GiB of zeros)
  // is named as such, not as an address space too small to map it.
  const SafetensorsLayout layout = safetensors_layout(path, file);
  void* mapped = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, file.descriptor(), 0);
  if (mapped == MAP_FAILED)
    fail("cannot map %s '%s' (%s bytes): %s%s", what.c_str(), path.c_str(), z2::with_commas(size_).c_str(),
         std::strerror(errno), errno == ENOMEM ? " (is the address space limited, ulimit -v, below its size?)" : "");
  bytes_ = (const char*)mapped;  // the descriptor may close now: the mapping keeps the file
  try {
    for (auto& [name, tensor] : layout.tensors)
      tensors_[name] = {tensor.dtype, tensor.shape, bytes_ + layout.data_start + tensor.begin,
                        tensor.end - tensor.begin};
  } catch (...) {  // the destructor does not run for a constructor that throws
    munmap(mapped, size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { munmap((void*)bytes_, size_); }

// --- a tensor's values --------------------------------------------------------------------

// Element `index` of a tensor of `shape`, as its indices ("[0, 12]").
static std::string element_at(const std::vector<long>& shape, size_t index) {
  std::vector<long> at(shape.size());
  for (size_t k = shape.size(); k-- > 0;) at[k] = (long)(index % (size_t)shape[k]), index /= (size_t)shape[k];
  std::string text = "[";
  for (size_t k = 0; k < at.size(); ++k) text += (k ? ", " : "") + std::to_string(at[k]);
  return text + "]";
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
  for (size_t i = 0; i < count; ++i)
    if (!std::isfinite(values[i]))
      fail("'%s': tensor '%s' element %zu %s is %g: weights to start from must be finite", path.c_str(), name.c_str(),
           i, element_at(tensor.shape, i).c_str(), values[i]);
  return values;
}

}  // namespace bert
