// runtime/simulated_device.cpp — the simulated device's scheduler (what it
// models and how it is adversarial: runtime/simulated_device.h). Host code:
// the operations are the cpu backend's loops, copies and products, run when
// the scheduler says, on the host thread.
#include "runtime/simulated_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace z2 {

const char* SimulatedDevice::stream_name(int stream) {
  static const char* names[] = {"compute", "comm", "copy"};
  return stream >= 0 && stream < streams ? names[stream] : "unknown";
}

static std::string where(const Site& site) {
  const char* slash = std::strrchr(site.file, '/');
  // The build compiles from the repository root, so a path is already
  // short; an absolute one keeps its last two parts.
  std::string file = site.file;
  if (slash && site.file[0] == '/') {
    const char* previous = slash;
    while (previous > site.file && *(previous - 1) != '/') --previous;
    file = previous > site.file ? previous : slash + 1;
  }
  return file + ":" + std::to_string(site.line) + " (" + site.function + ")";
}

static SimRaceLog* race_log = nullptr;  // the SimRaceLog alive now, if any
SimRaceLog::SimRaceLog() {
  if (race_log) usage_error("a SimRaceLog is already keeping this process's races");
  race_log = this;
}
SimRaceLog::~SimRaceLog() { race_log = nullptr; }

SimulatedDevice::SimulatedDevice(Compute& compute) : compute_(compute) {
  if (const char* schedule = std::getenv("Z2_SIM_SCHEDULE"); schedule && *schedule) {
    const std::string text = schedule;
    if (text.rfind("seed:", 0) == 0 && text.size() > 5 && text.find_first_not_of("0123456789", 5) == std::string::npos) {
      seeded_ = true;
      random_.seed(std::stoull(text.substr(5)));
    } else if (text != "late") {
      usage_error("Z2_SIM_SCHEDULE=%s: the simulated device's schedules are late (the default) and seed:N", schedule);
    }
  }
  if (const char* skip = std::getenv("Z2_SIM_SKIP"); skip && *skip) {
    std::string text = skip;
    for (size_t start = 0; start <= text.size();) {
      size_t comma = text.find(',', start);
      if (comma == std::string::npos) comma = text.size();
      if (comma > start) skips_.push_back({text.substr(start, comma - start), 0});
      start = comma + 1;
    }
  }
}

SimulatedDevice::~SimulatedDevice() {
  if (skips_.empty()) return;
  int initialized = 0, finalized = 0, rank = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) return;
  for (const auto& skip : skips_) fprintf(stderr, "[sim] skipped %s %ld times\n", skip.first.c_str(), skip.second);
}

// A site is skipped when Z2_SIM_SKIP names its file:line; the file may be
// given by its last parts ("zero2.cu:629" matches "./zero2.cu:629").
bool SimulatedDevice::skipped(const Site& site) {
  for (auto& skip : skips_) {
    const std::string here = std::string(site.file) + ":" + std::to_string(site.line);
    const std::string& wanted = skip.first;
    if (here.size() >= wanted.size() && here.compare(here.size() - wanted.size(), wanted.size(), wanted) == 0 &&
        (here.size() == wanted.size() || here[here.size() - wanted.size() - 1] == '/')) {
      skip.second += 1;
      return true;
    }
  }
  return false;
}

long SimulatedDevice::pending() const {
  long count = 0;
  for (const auto& queue : queues_) count += (long)queue.size();
  return count;
}

void SimulatedDevice::enqueue(int stream, SimOperation operation) {
  operation.number = ++queued_[stream];
  operation.asked = ++asked_;
  queues_[stream].push_back(std::move(operation));
  start_heads();
}

// What may start, starts: a head whose wait is met leaves its queue; a head
// that is work starts, and from now until it has run its destination holds
// NaN bits (unless it also reads those bytes: a copy onto itself).
void SimulatedDevice::start_heads() {
  for (bool changed = true; changed;) {
    changed = false;
    for (int s = 0; s < streams; ++s) {
      if (queues_[s].empty()) continue;
      SimOperation& head = queues_[s].front();
      if (head.wait_stream >= 0) {
        if (finished_[head.wait_stream] < head.wait_through) continue;
        queues_[s].pop_front();
        finished_[s] += 1;
        changed = true;
      } else if (!head.started) {
        head.started = true;
        if (!head.poison) continue;
        for (const ByteRange& write : head.writes) {
          bool also_read = false;
          for (const ByteRange& read : head.reads) also_read = also_read || read.overlaps(write);
          if (!also_read) std::memset((void*)write.begin, 0xff, (size_t)(write.end - write.begin));
        }
      }
    }
  }
}

// Two operations in flight on two streams at once are unordered: if their
// known bytes conflict (one writes what the other reads or writes), that is a race.
void SimulatedDevice::check_race(const SimOperation& running, int stream) const {
  for (int other = 0; other < streams; ++other) {
    if (other == stream || queues_[other].empty()) continue;
    const SimOperation& flight = queues_[other].front();
    if (!flight.started || flight.wait_stream >= 0) continue;
    auto conflict = [](const std::vector<ByteRange>& a, const std::vector<ByteRange>& b, ByteRange* where_) {
      for (const ByteRange& x : a)
        for (const ByteRange& y : b)
          if (x.overlaps(y)) return *where_ = {std::max(x.begin, y.begin), std::min(x.end, y.end)}, true;
      return false;
    };
    ByteRange both;
    const bool race = conflict(running.writes, flight.reads, &both) || conflict(running.writes, flight.writes, &both) ||
                      conflict(running.reads, flight.writes, &both);
    if (!race) continue;
    const std::string message = format_text(
        "a race on the simulated device: %s on the %s stream (asked at %s) and %s on the %s stream (asked at %s) "
        "are both in flight and touch the same %s bytes, one of them writing: neither waits for the other",
        running.what.c_str(), stream_name(stream), where(running.site).c_str(), flight.what.c_str(),
        stream_name(other), where(flight.site).c_str(), with_commas((size_t)(both.end - both.begin)).c_str());
    if (race_log) {
      if (race_log->races++ == 0) race_log->first = message;
      return;
    }
    abort_all_ranks("sim", message.c_str(), "the simulated device's scheduler", running.site.file, running.site.line);
  }
}

// Run the head of `stream` (it has started: its stream's earlier work is
// done and its waits are met).
void SimulatedDevice::run_head(int stream) {
  SimOperation& head = queues_[stream].front();
  check_race(head, stream);
  struct Running {  // the operations' own calls run now, on the host, while this is set
    bool& flag;
    explicit Running(bool& f) : flag(f) { flag = true; }
    ~Running() { flag = false; }
  } running(compute_.sim_running_);
  head.run();
  queues_[stream].pop_front();
  finished_[stream] += 1;
  start_heads();
}

// Of the heads that may run, the one asked for last (-1: none).
int SimulatedDevice::latest_runnable_head() {
  int latest = -1;
  for (int s = 0; s < streams; ++s) {
    if (queues_[s].empty() || !queues_[s].front().started || queues_[s].front().wait_stream >= 0) continue;
    if (latest < 0 || queues_[s].front().asked > queues_[latest].front().asked) latest = s;
  }
  return latest;
}

// With Z2_SIM_SCHEDULE=seed:N, before forced work: some runnable heads run
// first, drawn at random (a GPU is free to run them now).
void SimulatedDevice::interleave() {
  if (!seeded_) return;
  while (random_() % 2 == 0) {
    int runnable[streams], count = 0;
    for (int s = 0; s < streams; ++s)
      if (!queues_[s].empty() && queues_[s].front().started && queues_[s].front().wait_stream < 0) runnable[count++] = s;
    if (count == 0) return;
    run_head(runnable[random_() % count]);
  }
}

// Run `stream`'s operations until `through` of them have finished, and of
// the other streams only what they must (what a wait on the way needs).
void SimulatedDevice::finish_through(int stream, long through) {
  interleave();
  while (finished_[stream] < through) {
    SimOperation& head = queues_[stream].front();
    if (head.wait_stream >= 0) {
      finish_through(head.wait_stream, head.wait_through);
      start_heads();  // the wait is met now and leaves the queue
    } else {
      run_head(stream);
    }
  }
}

void SimulatedDevice::record(SimEvent& event, int stream, Site site) {
  if (skipped(site)) return;
  event.stream = stream;
  event.through = queued_[stream];
}

void SimulatedDevice::wait(int stream, const SimEvent& event, Site site) {
  if (skipped(site)) return;
  if (event.stream < 0 || event.stream == stream || finished_[event.stream] >= event.through) return;
  SimOperation operation;
  operation.what = "wait";
  operation.site = site;
  operation.wait_stream = event.stream;
  operation.wait_through = event.through;
  enqueue(stream, std::move(operation));
}

bool SimulatedDevice::query(SimEvent& event, Site) {
  if (event.stream < 0 || finished_[event.stream] >= event.through) return true;
  if (event.polled_at != event.through) {  // "not yet", once: the caller's waiting path runs
    event.polled_at = event.through;
    return false;
  }
  finish_through(event.stream, event.through);
  return true;
}

void SimulatedDevice::synchronize(int stream, Site site) {
  if (skipped(site)) return;
  finish_through(stream, queued_[stream]);
}

void SimulatedDevice::synchronize_all(Site site) {
  if (skipped(site)) return;
  interleave();
  for (int s = latest_runnable_head(); s >= 0; s = latest_runnable_head()) run_head(s);
  if (pending() != 0)  // cannot happen: a wait's event stands for earlier work, so no cycle exists
    abort_all_ranks("sim", "the simulated device's queues are stuck", "synchronize_all", __FILE__, __LINE__);
}

}  // namespace z2
