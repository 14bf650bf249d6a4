// trainer/inputs.cpp — reading the trainer's inputs (trainer/inputs.h): one
// reader for every file the run takes, the config file's text, SHA-256, and
// the fingerprints that show every rank reads the same files.
#include "trainer/inputs.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "trainer/json.h"

namespace bert {

// An input file opened: `what` names it in messages. It must be a regular
// file (a FIFO, a device or a terminal could block or never end:
// /dev/stdin, /dev/zero) of at most `max_bytes`, checked before reading.
// Opened once (O_NONBLOCK: opening a FIFO does not wait for a writer) and
// checked on that descriptor, so nothing can be swapped in between.
InputFile::InputFile(const std::string& what, const std::string& path, size_t max_bytes) : what_(what), path_(path) {
  if (path.empty()) fail("%s wants a path (got an empty one: an unset shell variable?)", what.c_str());
  descriptor_ = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (descriptor_ < 0) {
    const int error = errno;
    fail("cannot open %s '%s': %s%s", what.c_str(), path.c_str(), std::strerror(error),
         path_is_there(path) ? stat_hint(error) : "");
  }
  struct stat info;
  // The constructor may throw from here on: the destructor would not run.
  auto refuse = [&](const std::string& message) {
    close(descriptor_);
    fail("%s", message.c_str());
  };
  if (fstat(descriptor_, &info) != 0) refuse("cannot read " + what + " '" + path + "': " + std::strerror(errno));
  if (S_ISDIR(info.st_mode)) refuse(what + " '" + path + "' is a directory, not a file");
  if (!S_ISREG(info.st_mode))
    refuse(what + " '" + path +
           "' is not a regular file (a FIFO, a device or a terminal could block or never end): give a file");
  size_ = (size_t)info.st_size;
  if (size_ > max_bytes)
    refuse(z2::format_text("%s '%s' has %s bytes, more than the %s this trainer reads", what.c_str(), path.c_str(),
                           z2::with_commas(size_).c_str(), z2::with_commas(max_bytes).c_str()));
}
InputFile::~InputFile() { close(descriptor_); }
void InputFile::read_at(void* into, size_t bytes, size_t offset) const {
  for (size_t done = 0; done < bytes;) {
    const ssize_t got = pread(descriptor_, (char*)into + done, bytes - done, (off_t)(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      fail("cannot read %s '%s': %s", what_.c_str(), path_.c_str(), got < 0 ? std::strerror(errno) : "it ends early");
    done += (size_t)got;
  }
}

// An input file, read whole (InputFile's checks first): read to at most
// max_bytes + 1, so a file that grows (or a /proc file, size 0) cannot get
// past the bound either.
std::string read_regular_file(const std::string& what, const std::string& path, size_t max_bytes) {
  const InputFile file(what, path, max_bytes);
  auto too_large = [&](size_t bytes) {
    fail("%s '%s' has %s bytes or more, more than the %s this trainer reads", what.c_str(), path.c_str(),
         z2::with_commas(bytes).c_str(), z2::with_commas(max_bytes).c_str());
  };
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = read(file.descriptor(), buffer, std::min(sizeof buffer, max_bytes + 1 - text.size()));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("cannot read %s '%s': %s", what.c_str(), path.c_str(), std::strerror(errno));
    if (got == 0) break;
    text.append(buffer, (size_t)got);
    if (text.size() > max_bytes) too_large(text.size());
  }
  return text;
}

// Paths are looked at with stat and lstat (errno, not std::filesystem's
// exceptions), so a symlink loop or a dangling link gets a sentence.
const char* stat_hint(int error) {
  return error == ELOOP    ? " (a symlink loop: a link that leads back to itself)"
         : error == ENOENT ? " (a symlink to nothing)"
                           : "";
}
bool path_is_there(const std::string& path) {
  struct stat info;
  return lstat(path.c_str(), &info) == 0;
}

// How deep a config's objects and arrays may nest. DeepSpeed's go 3 deep;
// the JSON library recurses when it frees or prints a value, so a file
// nested 100,000 deep would overflow the stack: we count before it parses.
constexpr int max_config_depth = 16;

// A NUL byte would end the text early for some readers; the depth is
// counted before the JSON library sees the text.
std::string read_config_text(const std::string& path) {
  const std::string text = read_regular_file("the config file", path, 1 << 20);
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) fail("the config file '%s' has a NUL byte at offset %zu", path.c_str(), nul);
  const size_t deep = first_nesting_beyond(text, max_config_depth);
  if (deep != std::string::npos)
    fail("the config file '%s' nests objects and arrays more than %d deep (at offset %zu)", path.c_str(),
         max_config_depth, deep);
  return text;
}

// --- SHA-256, OpenSSL's -------------------------------------------------------
//
// OpenSSL's libcrypto computes it (its EVP digest interface): the digest
// FIPS 180-4 defines, the one index.json records for each rank file and
// index.sha256 for the index, as `sha256sum -c` checks it.

static std::string hex_digits(const unsigned char* digest, unsigned length) {
  std::string text;
  char pair[3];
  for (unsigned k = 0; k < length; ++k) snprintf(pair, sizeof pair, "%02x", digest[k]), text += pair;
  return text;
}
Sha256::Sha256() : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr || EVP_DigestInit_ex(context_, EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(context_);
    fail("OpenSSL's libcrypto could not start a SHA-256 digest");
  }
}
Sha256::~Sha256() { EVP_MD_CTX_free(context_); }
void Sha256::update(const void* data, size_t bytes) {
  if (EVP_DigestUpdate(context_, data, bytes) != 1) fail("OpenSSL's libcrypto failed to digest %zu bytes", bytes);
}
std::string Sha256::hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned length = 0;
  if (EVP_DigestFinal_ex(context_, digest, &length) != 1) fail("OpenSSL's libcrypto failed to end a SHA-256 digest");
  return hex_digits(digest, length);
}
std::string sha256_hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1)
    fail("OpenSSL's libcrypto failed to digest %zu bytes", bytes.size());
  return hex_digits(digest, length);
}

// On several hosts every rank reads its own copy of --data, --config and
// --load's index: they must be the same bytes, or the ranks would train on
// different data (nothing else would notice: the shapes agree). Each rank's
// sizes and SHA-256 go to every rank (one all-gather), so every rank finds
// the same difference and stops with the same message, naming the ranks and
// hosts that differ from rank 0.
void check_same_inputs(const Settings& settings, const std::string& corpus, const std::string& loaded_index,
                       const FileFingerprint& initial_weights, MPI_Comm world) {
  constexpr int inputs = 4;  // --data (the corpus as read), --config, --load's index.json, --init-hf's weights
  struct Fingerprint {
    char host[MPI_MAX_PROCESSOR_NAME + 1];
    char sha256[inputs][65];  // "" when not given
    long bytes[inputs];
  };
  Fingerprint mine = {};
  agree_on_errors(
      world,
      [&] {  // reading the config again may fail on one host: agreed before the all-gather
        int length = 0;
        MPI_Get_processor_name(mine.host, &length);
        const std::string config = settings.config.empty() ? "" : read_config_text(settings.config);
        const std::string* texts[inputs - 1] = {&corpus, &config, &loaded_index};
        for (int k = 0; k < inputs - 1; ++k) {
          snprintf(mine.sha256[k], 65, "%s", sha256_hex(*texts[k]).c_str());
          mine.bytes[k] = (long)texts[k]->size();
        }
        // --init-hf's weights were hashed as they were read (never held whole); without it, as an empty file
        const std::string weights = initial_weights.sha256.empty() ? sha256_hex("") : initial_weights.sha256;
        snprintf(mine.sha256[inputs - 1], 65, "%s", weights.c_str());
        mine.bytes[inputs - 1] = (long)initial_weights.bytes;
      },
      "every rank fingerprinted its inputs");
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  std::vector<Fingerprint> all((size_t)size);
  MPI_Request request;
  Z2_MPI_CHECK(
      MPI_Iallgather(&mine, (int)sizeof mine, MPI_BYTE, all.data(), (int)sizeof mine, MPI_BYTE, world, &request));
  z2::wait_request(&request, "the all-gather of every rank's input fingerprints");
  const char* names[inputs] = {"--data", "--config", "--load's index.json", "--init-hf's model.safetensors"};
  for (int k = 0; k < inputs; ++k) {
    std::string differing;
    for (int q = 1; q < size; ++q)
      if (std::strcmp(all[q].sha256[k], all[0].sha256[k]) != 0 || all[q].bytes[k] != all[0].bytes[k])
        differing += (differing.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " on " + all[q].host +
                     " has " + z2::with_commas((size_t)all[q].bytes[k]) + " bytes, SHA-256 " +
                     std::string(all[q].sha256[k]).substr(0, 12) + "...";
    if (!differing.empty())
      fail(
          "%s is not the same file on every rank: rank 0 on %s has %s bytes, SHA-256 %.12s...; %s. Every host "
          "needs the same copy (notes/07, \"Several machines\")",
          names[k], all[0].host, z2::with_commas((size_t)all[0].bytes[k]).c_str(), all[0].sha256[k], differing.c_str());
  }
}

}  // namespace bert
