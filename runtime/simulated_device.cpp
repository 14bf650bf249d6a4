// runtime/simulated_device.cpp — the simulated device's scheduler (what it
// models and how it is adversarial: runtime/simulated_device.h). Host code:
// the operations are the cpu backend's loops, copies and products, run when
// the scheduler says, on the host thread.
#include "runtime/simulated_device.h"
#include "runtime/timeline.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

namespace z2 {

// --- device memory, closed to the host ---------------------------------------------

// What is closed and opened (start -> bytes): the arena's blocks and the
// one region every other device buffer comes from. Few, because every
// synchronize opens and closes them all: one mprotect each (the doctest
// suite's thousands of small buffers, each its own mapping, made that 5x
// slower than the work itself). And every device buffer (start -> bytes),
// for the fault handler, which must tell a host access of device memory from
// any other crash, and name the buffer. One process has one simulated
// device in practice (the doctest suite's, or the trainer's); several would
// share these.
static std::map<char*, size_t>& device_mappings() {
  static std::map<char*, size_t> mappings;
  return mappings;
}
static std::map<char*, size_t>& device_buffers() {
  static std::map<char*, size_t> buffers;
  return buffers;
}
// The region the direct allocations and the caching allocator's segments
// come from: address space only (pages arrive when touched), whole pages a
// buffer, a freed one kept by its size for the next of that size (the same
// sizes come back, step after step).
struct DeviceRegion {
  static constexpr size_t reserved = (size_t)256 << 30;
  char* base = nullptr;
  size_t used = 0;
  std::multimap<size_t, char*> free_by_size;
};
static DeviceRegion& device_region() {
  static DeviceRegion region;
  return region;
}
static struct sigaction previous_segv_action;

// The host's call stack, as file:line where the build has line tables (-g1):
// addr2line on each frame's object, at its offset in that object.
static void print_host_stack() {
  fprintf(stderr, "[zero2] the host's call stack at the access, innermost first:\n");
  fflush(stderr);
  void* frames[16];
  const int depth = backtrace(frames, 16);
  for (int k = 3; k < depth; ++k) {  // 0: this function, 1: the handler, 2: the signal return; 3 made the access
    Dl_info info;
    if (!dladdr(frames[k], &info) || !info.dli_fname) continue;
    const size_t offset = (size_t)((char*)frames[k] - (char*)info.dli_fbase) - (k > 3 ? 1 : 0);  // a return address points past its call
    const std::string command = format_text("addr2line -f -C -p -e '%s' 0x%zx 1>&2", info.dli_fname, offset);
    if (std::system(command.c_str()) != 0) fprintf(stderr, "  %s +0x%zx\n", info.dli_fname, offset);
    if (info.dli_sname && !std::strcmp(info.dli_sname, "main")) break;
  }
}

// A host access of a closed page lands here. Not async-signal-safe, and need
// not be: the program stops either way, and this fault is synchronous (the
// host thread touched the page), so the rank's state is what it was.
static void host_touched_device_memory(int signal, siginfo_t* info, void* context) {
  char* address = (char*)info->si_addr;
  auto inside = [address](const std::map<char*, size_t>& ranges) {
    auto after = ranges.upper_bound(address);
    return after != ranges.begin() && address < std::prev(after)->first + std::prev(after)->second ? std::prev(after)
                                                                                                  : ranges.end();
  };
  const auto mapping = inside(device_mappings());
  if (mapping == device_mappings().end()) {
    sigaction(SIGSEGV, &previous_segv_action, nullptr);  // not ours: the crash it would have been
    (void)signal, (void)context;
    return;
  }
  const auto buffer = inside(device_buffers());
  const std::string which =
      buffer == device_buffers().end()
          ? std::string("device memory no live buffer holds (a freed buffer, or past a buffer's end)")
          : format_text("byte %s of a %s-byte device buffer", with_commas((size_t)(address - buffer->first)).c_str(),
                        with_commas(buffer->second).c_str());
  print_host_stack();
  const std::string message = format_text(
      "the host touched device memory: %s. On a GPU the host cannot reach device memory (an illegal access); "
      "the simulated device keeps that rule. Copy it with Compute::copy on a stream and synchronize that stream "
      "before the host reads it (the call stack is above)",
      which.c_str());
  abort_all_ranks("sim", message.c_str(), "a host access of device memory", __FILE__, __LINE__);
}

static void install_fault_handler() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  struct sigaction action = {};
  action.sa_sigaction = host_touched_device_memory;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_segv_action);
}

void SimulatedDevice::protect(int protection) {
  for (const auto& mapping : device_mappings())
    if (mprotect(mapping.first, mapping.second, protection) != 0)
      abort_all_ranks("sim", strerror(errno), "mprotect of the simulated device's memory", __FILE__, __LINE__);
}

void SimulatedDevice::open_memory() {
  if (memory_open_) return;
  protect(PROT_READ | PROT_WRITE);
  memory_open_ = true;
}

int SimulatedDevice::entries_ = 0;
bool SimulatedDevice::memory_open_ = false;
bool SimulatedDevice::memory_closed_ = true;

void SimulatedDevice::set_memory_closed(bool closed) {
  memory_closed_ = closed;
  if (!closed) open_memory();
  else if (memory_open_ && entries_ == 0) protect(PROT_NONE), memory_open_ = false;
}

// An operation's own calls run at once (Compute::runs_now_on_host); one
// that asked the device for more (a synchronize, a record) would run the
// queues from inside one of their operations.
SimulatedDevice::Entry::Entry(SimulatedDevice& d) : device(d) {
  if (device.compute_.sim_running_)
    abort_all_ranks("sim", "an operation on the simulated device called its device (a synchronize, record, wait or "
                    "query from inside a queued operation)", "the simulated device's scheduler", __FILE__, __LINE__);
  device.entries_ += 1;
}

SimulatedDevice::Entry::~Entry() {
  device.entries_ -= 1;
  if (device.entries_ == 0 && device.memory_open_ && device.memory_closed_) {
    device.protect(PROT_NONE);
    device.memory_open_ = false;
  }
}

static size_t whole_pages(size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return (std::max(bytes, (size_t)1) + page - 1) / page * page;
}

void* SimulatedDevice::map_memory(size_t bytes) {
  const size_t length = whole_pages(bytes);
  DeviceRegion& region = device_region();
  if (!region.base) {
    void* base = mmap(nullptr, DeviceRegion::reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
      abort_all_ranks("memory", "no address space for the simulated device", "mmap", __FILE__, __LINE__);
    region.base = (char*)base;
    madvise(base, DeviceRegion::reserved, MADV_HUGEPAGE);  // as the arena's block (adopt_memory): cheap to close
    device_mappings()[region.base] = DeviceRegion::reserved;
    if (memory_open_) protect(PROT_READ | PROT_WRITE);
  }
  char* pages = nullptr;
  auto reuse = region.free_by_size.find(length);
  if (reuse != region.free_by_size.end()) {
    pages = reuse->second;
    region.free_by_size.erase(reuse);
  } else {
    if (region.used + length > DeviceRegion::reserved)
      abort_all_ranks("memory", "the simulated device's 256 GiB of address space are used up", "map_memory", __FILE__,
                      __LINE__);
    pages = region.base + region.used;
    region.used += length;
  }
  device_buffers()[pages] = length;
  return pages;
}

// Its pages stay (giving them back would split the huge pages they share):
// the next buffer of its size takes them, and take() zero-fills it.
void SimulatedDevice::unmap_memory(void* pointer) {
  auto found = device_buffers().find((char*)pointer);
  if (found == device_buffers().end()) return;
  device_region().free_by_size.insert({found->second, found->first});
  device_buffers().erase(found);
}

void SimulatedDevice::adopt_memory(void* block, size_t bytes) {
  device_mappings()[(char*)block] = whole_pages(bytes);
  device_buffers()[(char*)block] = whole_pages(bytes);
  // Huge pages where the kernel has them: mprotect rewrites one entry per
  // page it covers, and the block is closed and opened again at every
  // synchronize; 2 MiB pages make that 512 times cheaper than 4 KiB ones.
  madvise(block, whole_pages(bytes), MADV_HUGEPAGE);
  if (!memory_open_ && mprotect(block, whole_pages(bytes), PROT_NONE) != 0)
    abort_all_ranks("sim", strerror(errno), "mprotect of the simulated device's memory", __FILE__, __LINE__);
}

void SimulatedDevice::forget_memory(void* block) {
  device_mappings().erase((char*)block);
  device_buffers().erase((char*)block);
}

void SimulatedDevice::peek(void* host, const void* device, size_t bytes) {
  Entry entry(*this);
  open_memory();
  std::memcpy(host, device, bytes);
}

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
  install_fault_handler();
  if (const char* schedule = std::getenv("Z2_SIM_SCHEDULE"); schedule && *schedule) {
    const std::string text = schedule;
    if (text.rfind("seed:", 0) == 0 && text.size() > 5 && text.find_first_not_of("0123456789", 5) == std::string::npos) {
      seeded_ = true;
      random_.seed(std::stoull(text.substr(5)));
    } else if (text != "late") {
      usage_error("Z2_SIM_SCHEDULE=%s: the simulated device's schedules are late (the default) and seed:N", schedule);
    }
  }
  if (const char* count = std::getenv("Z2_SIM_COUNT"); count && *count) counting_ = true;
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
  if (skips_.empty() && !counting_) return;
  int initialized = 0, finalized = 0, rank = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) return;
  for (const auto& skip : skips_) fprintf(stderr, "[sim] skipped %s %ld times\n", skip.first.c_str(), skip.second);
  for (const auto& site : asked_at_) fprintf(stderr, "[sim] asked %s %ld times\n", site.first.c_str(), site.second);
}

// A site is skipped when Z2_SIM_SKIP names its file:line; the file may be
// given by its last parts ("zero2.cu:629" matches "./zero2.cu:629").
// (Z2_SIM_COUNT=1 counts every site asked for: which sites a run reaches.)
bool SimulatedDevice::skipped(const Site& site) {
  if (counting_) asked_at_[std::string(site.file) + ":" + std::to_string(site.line)] += 1;
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

// With --timeline, the model gives the operation its virtual times now, as
// it is asked for (runtime/timeline.h); the host's clock stops meanwhile.
void SimulatedDevice::enqueue(int stream, SimOperation operation) {
  Entry entry(*this);
  const HostClockPaused paused(compute_.timeline());
  if (Timeline* timeline = compute_.timeline()) timeline->sim_queued(stream, operation.site, operation.work);
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
          if (also_read) continue;
          open_memory();
          std::memset((void*)write.begin, 0xff, (size_t)(write.end - write.begin));
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
  run_one(stream);
  start_heads();
}

void SimulatedDevice::run_one(int stream) {
  const HostClockPaused paused(compute_.timeline());  // the device's work is not the host's time
  check_race(queues_[stream].front(), stream);
  // Out of the queue before it runs: an operation that throws is not run
  // again by the next synchronize, and still counts as finished.
  const SimOperation head = std::move(queues_[stream].front());
  queues_[stream].pop_front();
  struct Running {  // the operations' own calls run now, on the host, while this is set
    bool& flag;
    long& finished;
    Running(bool& f, long& done) : flag(f), finished(done) { flag = true; }
    ~Running() { flag = false, finished += 1; }
  } running(compute_.sim_running_, finished_[stream]);
  open_memory();
  head.run();
}

// Of the heads that may run and are needed (one of the first need[s] of
// their stream), the one asked for last (-1: none).
int SimulatedDevice::latest_runnable_head(const long* need) {
  int latest = -1;
  for (int s = 0; s < streams; ++s) {
    if (queues_[s].empty() || !queues_[s].front().started || queues_[s].front().wait_stream >= 0) continue;
    if (queues_[s].front().number > need[s]) continue;
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
// the other streams only what they must (what a wait on the way needs, and
// what that needs in turn). Of what must run, the head that may run and was
// asked for last runs first: of two unordered operations the later-asked one
// (a reader its missing wait should have held back, or an overwrite) runs
// before the earlier one, not after it as the queues' order would have it.
void SimulatedDevice::finish_through(int stream, long through) {
  interleave();
  long need[streams] = {};  // the first need[s] operations of stream s must finish
  need[stream] = through;
  for (bool grew = true; grew;) {  // the waits among what must run need their events' work too
    grew = false;
    for (int s = 0; s < streams; ++s)
      for (const SimOperation& operation : queues_[s])
        if (operation.number <= need[s] && operation.wait_stream >= 0 &&
            need[operation.wait_stream] < operation.wait_through)
          need[operation.wait_stream] = operation.wait_through, grew = true;
  }
  run_needed(need);
}

// Run the needed operations, the latest-asked runnable head first.
void SimulatedDevice::run_needed(const long* need) {
  for (int s = latest_runnable_head(need); s >= 0; s = latest_runnable_head(need)) run_head(s);
  for (int s = 0; s < streams; ++s)  // cannot happen: a wait's event stands for earlier work, so no cycle exists
    if (finished_[s] < need[s])
      abort_all_ranks("sim", "the simulated device's queues are stuck", "the scheduler", __FILE__, __LINE__);
}

void SimulatedDevice::record(SimEvent& event, int stream, Site site) {
  if (skipped(site)) return;
  event.stream = stream;
  event.through = queued_[stream];
}

void SimulatedDevice::wait(int stream, const SimEvent& event, Site site) {
  if (skipped(site)) return;
  // In the model the wait holds even when the scheduler ran the work already.
  if (Timeline* timeline = compute_.timeline()) timeline->sim_waits(stream, event.stream, event.through);
  if (event.stream < 0 || event.stream == stream || finished_[event.stream] >= event.through) return;
  SimOperation operation;
  operation.what = "wait";
  operation.site = site;
  operation.wait_stream = event.stream;
  operation.wait_through = event.through;
  enqueue(stream, std::move(operation));
}

// With --timeline, a yes (and a synchronize) moves the host's clock to the
// modelled end of what it waited for.
bool SimulatedDevice::query(SimEvent& event, Site) {
  Entry entry(*this);
  Timeline* timeline = compute_.timeline();
  if (event.stream >= 0 && finished_[event.stream] < event.through) {
    if (event.polled_at != event.through) {  // "not yet", once: the caller's waiting path runs
      event.polled_at = event.through;
      return false;
    }
    finish_through(event.stream, event.through);
  }
  if (timeline && event.stream >= 0) timeline->sim_host_waits(event.stream, event.through);
  return true;
}

void SimulatedDevice::synchronize(int stream, Site site) {
  Entry entry(*this);
  if (skipped(site)) return;
  finish_through(stream, queued_[stream]);
  if (Timeline* timeline = compute_.timeline()) timeline->sim_host_waits(stream, queued_[stream]);
}

void SimulatedDevice::synchronize_all(Site site) {
  Entry entry(*this);
  if (skipped(site)) return;
  if (Timeline* timeline = compute_.timeline())
    for (int s = 0; s < streams; ++s) timeline->sim_host_waits(s, queued_[s]);
  interleave();
  run_needed(queued_);
}

}  // namespace z2
