// trainer/output_files.cpp — the one writer and the checks on outputs
// (trainer/output_files.h).
#include "trainer/output_files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>
#include <vector>

namespace bert {

// --- output files (notes/14, "What it guards against") -----------------------
//
// Every file the trainer writes goes through write_output_file:
//   0. the path must name nothing yet or a regular file; a symlink is
//      followed to the file it names (output_destination);
//   1. the contents go to a file with no name yet (O_TMPFILE in the target
//      directory), then fsync: on the disk, not only in the cache. A run
//      killed here (a signal, the watchdog, a crash) leaves nothing behind:
//      the kernel frees a file that has no name;
//   2. the file gets a temporary name no other writer can pick (the pid,
//      the rank, a random number), then is renamed over the final name
//      (atomic within a directory), then the directory is synced so the
//      rename itself survives a crash.
// Where the file system has no O_TMPFILE the file is written under the
// temporary name from the start. A failure at any point removes the
// temporary and throws with the path and the system's reason (strerror):
// nothing under a final name is ever partial. The caller runs it inside
// agree_on_errors, so a write that fails on one rank ends every rank, with
// exit 2 and rank 0's message.
std::string directory_of(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// A name in `directory` for a temporary file of `name` that no other
// process or rank picks; at most 255 bytes whatever the name's length
// (the name is cut to 160: it is only there to tell a person what it was).
static std::string unique_temporary(const std::string& directory, const std::string& name) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::random_device random;
  char suffix[80];
  snprintf(suffix, sizeof suffix, ".zero2-tmp.%ld.%d.%08x", (long)getpid(), rank, (unsigned)random());
  return directory + "/." + name.substr(0, 160) + suffix;
}

// For tests only: ZERO2_TEST_FAULT="stop K" or "kill K" stops (SIGSTOP) or
// kills (SIGKILL) this process halfway through writing its K-th output
// file (1-based, counted per process), to show what a failure mid-write
// leaves (tests/cli/reliability.sh); "kill K R" does it on rank R only.
// Unset, it costs one getenv per file.
static void fault_for_tests(int file_number) {
  const char* fault = std::getenv("ZERO2_TEST_FAULT");
  if (fault == nullptr) return;
  char action[8] = {};
  int target = 0, only_rank = -1, rank = 0;
  if (std::sscanf(fault, "%7s %d %d", action, &target, &only_rank) < 2 || target != file_number) return;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (only_rank >= 0 && only_rank != rank) return;
  if (std::strcmp(action, "stop") == 0) raise(SIGSTOP);
  if (std::strcmp(action, "kill") == 0) raise(SIGKILL);
}

void sync_directory(const std::string& directory, const std::string& done) {
  const int folder = open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder < 0 || fsync(folder) != 0) {
    const int error = errno;
    if (folder >= 0) close(folder);
    fail("%s, but the directory '%s' could not be synced: %s", done.c_str(), directory.c_str(), std::strerror(error));
  }
  close(folder);
}

// What an output path may name, since the writer renames a new file over
// it and a rename replaces whatever is there: nothing yet, or a regular
// file. A device, a FIFO, a socket or a directory is refused (as root,
// `--json /dev/null` would otherwise turn /dev/null into a file for the
// whole machine). A symlink is followed: the file written is its target,
// made beside the target and renamed over it, so the link stays a link;
// one that leads nowhere is refused. Returns the path to write, and is
// asked twice: before step 1 (check_output_file) and again at the write,
// since the run may have lasted hours.
static const char* file_kind(mode_t mode) {
  return S_ISDIR(mode)    ? "a directory"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISBLK(mode)  ? "a block device"
         : S_ISFIFO(mode) ? "a FIFO"
         : S_ISSOCK(mode) ? "a socket"
                          : "not a regular file";
}
std::string output_destination(const std::string& what, const std::string& path) {
  struct stat info;
  if (lstat(path.c_str(), &info) != 0) return path;  // nothing there yet (other errors show when writing)
  std::string destination = path;
  if (S_ISLNK(info.st_mode)) {
    char* resolved = realpath(path.c_str(), nullptr);
    if (resolved == nullptr)
      fail(
          "%s '%s' is a symlink that leads to no file (%s): zero2 writes through a symlink only to an existing "
          "regular file; remove the link or point it at one",
          what.c_str(), path.c_str(), std::strerror(errno));
    destination = resolved;
    free(resolved);
    if (stat(destination.c_str(), &info) != 0)
      fail("%s '%s': cannot look at its target '%s': %s", what.c_str(), path.c_str(), destination.c_str(),
           std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode))
    fail("%s '%s'%s is %s: zero2 writes only regular files and never replaces anything else; give another path",
         what.c_str(), path.c_str(), destination == path ? "" : (" (a symlink to '" + destination + "')").c_str(),
         file_kind(info.st_mode));
  return destination;
}

void write_output_file(const std::string& written_path, const std::string& contents) {
  static int files_written = 0;
  const int file_number = ++files_written;
  const std::string path = output_destination("the output", written_path);
  const std::string directory = directory_of(path);
  const std::string temporary = unique_temporary(directory, std::filesystem::path(path).filename().string());
  // A file that is replaced keeps its permissions; a new one gets 0666
  // less the umask, as any program's new file does.
  struct stat old;
  const bool replacing = stat(path.c_str(), &old) == 0 && S_ISREG(old.st_mode);
  const mode_t mode = replacing ? (old.st_mode & 07777) : 0666;
  int file = open(directory.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, mode);
  const bool nameless = file >= 0;
  if (!nameless) file = open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (file < 0) fail("cannot write '%s': %s", path.c_str(), std::strerror(errno));
  if (replacing) fchmod(file, mode);  // exactly the old mode, whatever the umask
  bool named = !nameless;
  auto give_up = [&](const char* doing) {
    const int error = errno;
    close(file);
    if (named) unlink(temporary.c_str());
    fail("cannot write '%s': %s (%s)", path.c_str(), std::strerror(error), doing);
  };
  auto write_range = [&](size_t begin, size_t end) {
    for (size_t done = begin; done < end;) {
      const ssize_t wrote = write(file, contents.data() + done, end - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) give_up("writing");
      done += (size_t)wrote;
    }
  };
  write_range(0, contents.size() / 2);
  fault_for_tests(file_number);
  write_range(contents.size() / 2, contents.size());
  if (fsync(file) != 0) give_up("fsync");
  if (nameless) {  // the file gets its temporary name only now, complete and on the disk
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", file);
    if (linkat(AT_FDCWD, self, AT_FDCWD, temporary.c_str(), AT_SYMLINK_FOLLOW) != 0) give_up("naming the temporary");
    named = true;
  }
  if (close(file) != 0) {
    const int error = errno;
    unlink(temporary.c_str());
    fail("cannot write '%s': %s (closing)", path.c_str(), std::strerror(error));
  }
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    unlink(temporary.c_str());
    fail("cannot write '%s': %s (renaming the temporary over it)", path.c_str(), std::strerror(error));
  }
  sync_directory(directory, "wrote '" + path + "'");
}

// Who holds the flock on the directory open as `fd`, for the message that
// refuses a second run: the kernel lists every lock in /proc/locks with the
// holder's pid and the locked file's device and inode, and /proc/<pid>/cmdline
// says what that process is. Only a process on this host can be named; on a
// shared file system the holder may be on another machine ("" then).
static std::string lock_holder(int fd) {
  struct stat info;
  if (fstat(fd, &info) != 0) return "";
  FILE* locks = std::fopen("/proc/locks", "r");
  if (locks == nullptr) return "";
  char line[256];
  long holder = -1;
  while (holder < 0 && std::fgets(line, sizeof line, locks)) {
    // "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF" (a blocked waiter's line has "->")
    char kind[16], mode[16], access[16];
    long pid = 0;
    unsigned major = 0, minor = 0;
    unsigned long long inode = 0;
    if (std::strstr(line, "->") == nullptr &&
        std::sscanf(line, "%*d: %15s %15s %15s %ld %x:%x:%llu", kind, mode, access, &pid, &major, &minor, &inode) ==
            7 &&
        std::strcmp(kind, "FLOCK") == 0 && inode == (unsigned long long)info.st_ino &&
        makedev(major, minor) == info.st_dev)
      holder = pid;
  }
  std::fclose(locks);
  if (holder <= 0) return "";
  std::string command;
  if (FILE* cmdline = std::fopen(("/proc/" + std::to_string(holder) + "/cmdline").c_str(), "r")) {
    for (int c; (c = std::fgetc(cmdline)) != EOF && command.size() < 200;) command += c ? (char)c : ' ';
    std::fclose(cmdline);
  }
  while (!command.empty() && command.back() == ' ') command.pop_back();
  return "process " + std::to_string(holder) + (command.empty() ? "" : ": " + command);
}

DirectoryLock::DirectoryLock(const std::string& directory, OnBusy on_busy, const std::string& busy)
    : fd_(open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
  if (fd_ < 0) fail("cannot lock the directory '%s' for writing: %s", directory.c_str(), std::strerror(errno));
  if (on_busy == OnBusy::refuse) {
    if (flock(fd_, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) return;
    const std::string holder = lock_holder(fd_);
    close(fd_);
    fd_ = -1;
    throw z2::Error(busy + (holder.empty() ? "" : " (the lock's holder: " + holder + ")"));
  }
  z2::wait_until(
      [&] {
        if (flock(fd_, LOCK_EX | LOCK_NB) == 0) return true;
        if (errno != EWOULDBLOCK && errno != EINTR)
          fail("cannot lock the directory '%s' for writing: %s", directory.c_str(), std::strerror(errno));
        return false;
      },
      [&] { return "the lock on the directory '" + directory + "' (another process is writing into it)"; });
}
DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) close(fd_);  // closing releases the lock
}

// That a file can be created in `directory`, and the directory opened for
// the sync after a rename (and the export's lock): a temporary made and
// removed now, before training, so a read-only or foreign directory fails
// in the first second and not after the run. (A full disk shows only when
// writing.)
static void probe_writable(const std::string& flag, const std::string& directory) {
  const int folder = open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder < 0) fail("%s: cannot open the directory '%s': %s", flag.c_str(), directory.c_str(), std::strerror(errno));
  close(folder);
  const std::string probe = unique_temporary(directory, "probe");
  const int file = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (file < 0)
    fail("%s: cannot create files in the directory '%s': %s", flag.c_str(), directory.c_str(), std::strerror(errno));
  close(file);
  unlink(probe.c_str());
}
static bool is_directory(const std::string& path) {
  std::error_code ignored;  // a path we cannot look at is not a directory we can use
  return std::filesystem::is_directory(path, ignored);
}
void prepare_directory(const std::string& flag, const std::string& directory) {
  struct stat info;
  if (stat(directory.c_str(), &info) == 0 && !S_ISDIR(info.st_mode))
    fail("%s '%s' is %s, not a directory: give a directory (it is made if it does not exist)", flag.c_str(),
         directory.c_str(), S_ISREG(info.st_mode) ? "a file" : file_kind(info.st_mode));
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (!is_directory(directory))
    fail("%s '%s' cannot be created as a directory%s%s", flag.c_str(), directory.c_str(), error ? ": " : "",
         error ? error.message().c_str() : "");
  probe_writable(flag, directory);
}
// A file we will write: its directory exists and takes files, its name
// fits the file system, and it is not a directory.
static void check_output_file(const std::string& flag, const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  if (name.empty() || name == "." || name == "..")
    fail("%s '%s' names a directory, not a file", flag.c_str(), path.c_str());
  if (!is_directory(directory_of(path)))
    fail("%s '%s': the directory '%s' does not exist", flag.c_str(), path.c_str(), directory_of(path).c_str());
  probe_writable(flag, directory_of(output_destination(flag, path)));  // a symlink's target's directory
}

// A directory that must hold nothing yet (or not exist): `holds` is what it
// will hold, for the message. A trace mixed with an earlier run's files
// would be a trace of neither.
void check_empty_directory(const std::string& flag, const std::string& directory, const char* holds) {
  std::error_code error;
  if (!is_directory(directory)) return;  // made later; not a directory at all is prepare_directory's message
  std::filesystem::directory_iterator entries(directory, error);
  if (error) fail("%s: cannot read the directory '%s': %s", flag.c_str(), directory.c_str(), error.message().c_str());
  if (entries != std::filesystem::directory_iterator())
    fail(
        "%s '%s' is not empty: %s goes into a new or empty directory, so that nothing in it is another run's "
        "(remove it first, or give another)",
        flag.c_str(), directory.c_str(), holds);
}

// Each name in an output's path fits a file system (255 bytes, NAME_MAX on
// Linux's): checked first, since every later check would fail on it with
// the system's less helpful "File name too long".
static void check_name_lengths(const std::string& what, const std::string& path) {
  for (const auto& part : std::filesystem::path(path))
    if (part.string().size() > NAME_MAX)
      fail("%s '%s': the name '%s...' has %zu bytes, more than the %d a file name may have", what.c_str(), path.c_str(),
           part.string().substr(0, 24).c_str(), part.string().size(), NAME_MAX);
}

// Compared as absolute paths, normalised, symlinks resolved as far as the
// path exists, without a trailing slash ("d", "./d/" and "/abs/d" are one
// directory, whether or not it exists yet). A path that cannot be resolved
// (a directory we may not read) is compared as written, made absolute: the
// checks that follow say what is wrong with it.
static std::string normal_path(const std::string& path) {
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(path, error);
  std::filesystem::path full = std::filesystem::weakly_canonical(absolute, error);
  if (error) full = absolute;
  std::string text = full.lexically_normal().string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

// Every output, up front (rank 0 writes them all): no output may be an
// input (the run would overwrite its own --data or --config, and exit 0)
// or another output (one would overwrite the other), whether a file or a
// directory; an export or a dump directory counts with the files it will
// hold. The checkpoint --load reads is an input whole: nothing may be
// written in its step directory (its index, its rank files), nor over the
// `latest` that named it, except by --save, whose `latest` moves only
// after the load and only to a newer complete step. Then each file's own
// checks (check_output_file).
void check_outputs(const Settings& s) {
  struct Place {
    std::string what, path;
    bool directory;
  };
  std::vector<Place> inputs, outputs;
  if (!s.data.empty()) inputs.push_back({"--data", s.data, false});
  if (!s.config.empty()) inputs.push_back({"--config", s.config, false});
  if (!s.init_hf.empty())
    for (const char* name : {"config.json", "model.safetensors"})
      inputs.push_back({std::string("--init-hf's ") + name, s.init_hf + "/" + name, false});
  if (!s.checkpoint_directory.empty()) {
    inputs.push_back({"--load checkpoint's", s.checkpoint_directory, true});
    if (normal_path(s.checkpoint_directory) != normal_path(s.load_dir))
      inputs.push_back({"--load checkpoint's latest", s.load_dir + "/latest", false});
  }
  if (!s.json_path.empty()) outputs.push_back({"--json", s.json_path, false});
  if (!s.memory_trace.empty()) outputs.push_back({"--memory-trace", s.memory_trace, false});
  if (!s.timeline.empty()) outputs.push_back({"--timeline", s.timeline, false});
  if (!s.metrics.empty()) outputs.push_back({"--metrics", s.metrics, false});
  for (auto [flag, directory] : {std::pair<std::string, std::string>{"--export-hf", s.export_dir},
                                 {"--dump-batch", s.dump_dir},
                                 {"--save", s.save_dir},
                                 {"--trace", s.trace_dir}}) {
    if (directory.empty()) continue;
    outputs.push_back({flag, directory, true});
    std::vector<std::string> names = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json"};
    if (flag == "--dump-batch") names.push_back("batch.safetensors");
    if (flag == "--save") names = {"latest"};
    if (flag == "--trace") names = {"trace.json", "batches.safetensors"};
    for (auto& name : names) outputs.push_back({flag + "'s " + name, directory + "/" + name, false});
  }
  std::vector<std::string> normal;
  for (auto& output : outputs) {
    check_name_lengths(output.what, output.path);
    normal.push_back(normal_path(output.path));
  }
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (auto& input : inputs) {
      const std::string read = normal_path(input.path);
      if (input.directory && (normal[o] == read || normal[o].rfind(read + "/", 0) == 0))
        fail(
            "%s '%s' is inside the checkpoint it loads, '%s': the run would write over what it reads; give a "
            "path outside it",
            outputs[o].what.c_str(), outputs[o].path.c_str(), input.path.c_str());
      const bool saves_over_latest = outputs[o].what == "--save's latest" && input.what == "--load checkpoint's latest";
      if (!input.directory && normal[o] == read && !saves_over_latest)
        fail("%s '%s' is the %s file: the run would overwrite its own input", outputs[o].what.c_str(),
             outputs[o].path.c_str(), input.what.c_str());
    }
    // The trace directory holds the trace alone (its step_<s> and initial/ too).
    const std::string trace = s.trace_dir.empty() ? "" : normal_path(s.trace_dir);
    if (!trace.empty() && normal[o].rfind(trace + "/", 0) == 0 && outputs[o].what.rfind("--trace", 0) != 0)
      fail("%s '%s' is inside --trace '%s', which holds the trace alone: give a path outside it",
           outputs[o].what.c_str(), outputs[o].path.c_str(), s.trace_dir.c_str());
    for (size_t other = 0; other < o; ++other)
      if (normal[o] == normal[other])
        fail("%s and %s name the same %s '%s': one would overwrite the other", outputs[other].what.c_str(),
             outputs[o].what.c_str(),
             outputs[o].directory && outputs[other].directory   ? "directory"
             : outputs[o].directory || outputs[other].directory ? "path"
                                                                : "file",
             outputs[o].path.c_str());
  }
  if (!s.trace_dir.empty()) check_empty_directory("--trace", s.trace_dir, "a trace");
  for (auto& output : outputs)
    if (output.directory) prepare_directory(output.what, output.path);
    else check_output_file(output.what, output.path);
}

MetricsStream::MetricsStream(const std::string& path, const std::string& resumed_marker) : path_(path) {
  struct stat info;
  const bool continuing = !resumed_marker.empty() && stat(output_destination("--metrics", path).c_str(), &info) == 0;
  if (!continuing) write_output_file(path, "");
  fd_ = open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
  if (fd_ < 0) fail("cannot append to --metrics '%s': %s", path.c_str(), std::strerror(errno));
  if (!continuing) return;
  char last = '\n';  // a line cut short (a full disk) is ended, so the marker starts a line of its own
  if (info.st_size > 0 && pread(fd_, &last, 1, info.st_size - 1) == 1 && last != '\n') write_line("\n");
  write_line(resumed_marker + "\n");
}
MetricsStream::~MetricsStream() {
  if (fd_ >= 0) close(fd_);
}
void MetricsStream::append(const std::string& record) { write_line(record + "\n"); }
void MetricsStream::write_line(const std::string& line) {
  const ssize_t wrote = write(fd_, line.data(), line.size());
  if (wrote != (ssize_t)line.size() || fdatasync(fd_) != 0)
    fail("cannot append to --metrics '%s': %s", path_.c_str(), wrote < 0 ? std::strerror(errno) : "a short write");
}

}  // namespace bert
