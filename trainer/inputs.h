// trainer/inputs.h — what the trainer reads: a file opened or read whole,
// refused with its reason when it cannot be an input (a FIFO, a device, too
// large; a dangling link or a link loop said as such), the config file's
// text, SHA-256 fingerprints, and the check that every rank reads the same
// --data, --config, --load and --init-hf. Defined in trainer/inputs.cpp;
// the corpus itself is read by the model's data section (train_bert_mini.cu,
// read_corpus), what a config means by trainer/deepspeed_config.cpp.
// Layer: inputs, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <openssl/types.h>  // EVP_MD_CTX: OpenSSL's digest state (libcrypto computes the SHA-256)

#include <cstddef>
#include <string>

#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// An input file opened for reading, not yet read: `what` names it in
// messages. Opened once and checked on that descriptor: a regular file (not
// a FIFO, a device, a directory) of at most `max_bytes`. Closed when it goes.
class InputFile {
 public:
  InputFile(const std::string& what, const std::string& path, size_t max_bytes);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  int descriptor() const { return descriptor_; }
  size_t size() const { return size_; }  // as fstat saw it when opened
  // Exactly `bytes` bytes at `offset` (pread), or a message naming the file.
  void read_at(void* into, size_t bytes, size_t offset) const;

 private:
  std::string what_, path_;
  int descriptor_ = -1;
  size_t size_ = 0;
};
// An input file, read whole: `what` names it in messages; at most `max_bytes`.
std::string read_regular_file(const std::string& what, const std::string& path, size_t max_bytes);
// Why stat failed on a name that is there (lstat finds it): " (a symlink
// loop: ...)" for ELOOP, " (a symlink to nothing)" for ENOENT, else "".
const char* stat_hint(int error);
// Anything under that name, a dangling link included (lstat).
bool path_is_there(const std::string& path);
// The config file (--config) as text, refused with its reason: not a
// regular file (a FIFO would block), larger than a config can be, a NUL
// byte, nested too deep. Read by trainer/deepspeed_config.cpp, recorded by
// the trace, fingerprinted by every rank (check_same_inputs).
std::string read_config_text(const std::string& path);

// SHA-256 (FIPS 180-4), streamed: OpenSSL's, through its EVP interface.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t bytes);
  // The digest as 64 hex digits; the object is spent afterwards.
  std::string hex();

 private:
  EVP_MD_CTX* context_;
};
std::string sha256_hex(const std::string& bytes);

// A file's SHA-256 (64 hex digits) and size, for comparing a file the
// ranks do not hold whole (--init-hf's weights, hashed while mapped).
struct FileFingerprint {
  std::string sha256;  // "" when there is no file
  size_t bytes = 0;
};
// On several hosts: every rank's --data (the corpus as read), --config,
// --load's index (`loaded_index`, as trainer/checkpoints.h's
// loaded_index_text gives it; "" without --load) and --init-hf's weights
// (`initial_weights`, its fingerprint; none without --init-hf) are the same
// bytes, or every rank stops with one message.
void check_same_inputs(const Settings& settings, const std::string& corpus, const std::string& loaded_index,
                       const FileFingerprint& initial_weights, MPI_Comm world);

}  // namespace bert
