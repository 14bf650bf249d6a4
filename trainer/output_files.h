// trainer/output_files.h — every file the trainer writes goes through one
// writer (write_output_file): nothing under a final name is ever partial, a
// failure names the path and the system's reason. Here too what guards the
// outputs before step 1 (check_outputs: no output is an input or another
// output, each can be written), the directory lock of --save and the export,
// and --metrics, the one output that grows in place. Its own file because the
// writing is the same for the summary, the export, the checkpoints and the
// plan; defined in trainer/output_files.cpp.
// Layer: inputs, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <string>

#include "trainer/settings.h"

namespace bert {

// The directory a path's file is in ("." for a bare name).
std::string directory_of(const std::string& path);
// A directory's entries made durable (a rename in it is on the disk once
// this returns); `done` says what was done, for the message.
void sync_directory(const std::string& directory, const std::string& done);
// The path to write for an output path: itself (nothing there yet, or a
// regular file) or a symlink's target; anything else is refused. `what`
// names it in the message.
std::string output_destination(const std::string& what, const std::string& path);
// The one writer: `contents` under `written_path`, whole or not at all.
void write_output_file(const std::string& written_path, const std::string& contents);
// A directory we will write into: create it (and its parents) now, and probe it.
void prepare_directory(const std::string& flag, const std::string& directory);
// Every output, up front (rank 0 writes them all), checked against the inputs and each other.
void check_outputs(const Settings& s);
// A directory that must hold nothing yet (or not exist): `holds` is what it
// will hold, for the message (--trace's: a trace mixed with an earlier run's
// files would be a trace of neither).
void check_empty_directory(const std::string& flag, const std::string& directory, const char* holds);

// An exclusive lock on a directory (flock on the directory itself: no lock
// file is left), for two writers:
//   - an export (model.safetensors, then config.json): two runs exporting
//     into one directory take turns (OnBusy::wait), so the directory never
//     holds one run's weights under the other's config. The lock is polled
//     against the watchdog's deadline: a run that holds it for too long ends
//     this one with a message that says so;
//   - --save and --trace, for the whole run (OnBusy::refuse): two runs saving
//     into one directory would replace each other's steps and latest, two
//     traces would mix, so the second is refused before its first step with
//     `busy` and, when the holder runs on this host, its pid and command line
//     (/proc/locks). A file system without flock gives no lock there; the
//     run goes on without one.
class DirectoryLock {
 public:
  enum class OnBusy { wait, refuse };
  DirectoryLock(const std::string& directory, OnBusy on_busy, const std::string& busy = "");
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

// --metrics FILE: JSON Lines, one object per progress line, appended while
// training runs (a plotting script or a dashboard can follow it). It is the
// one output that grows in place, so it cannot be renamed into place whole:
// the writer creates it empty (nameless until complete, as every output),
// then each line is one write() of the whole line followed by fdatasync, so
// a killed run leaves every line it logged, whole. Rank 0 only.
// A resumed run (--load) continues the file it is given instead of
// emptying it, after a line {"resumed_from": step directory, "step": s}:
// lines above it past step s are from a run that went on after that
// Each line is the JSON text of one record (trainer/reports.cpp makes them).
class MetricsStream {
 public:
  // `resumed_marker`: the line that marks a resume, "" for a fresh run.
  MetricsStream(const std::string& path, const std::string& resumed_marker);
  ~MetricsStream();
  MetricsStream(const MetricsStream&) = delete;
  MetricsStream& operator=(const MetricsStream&) = delete;
  void append(const std::string& record);

 private:
  void write_line(const std::string& line);
  std::string path_;
  int fd_ = -1;
};

}  // namespace bert
