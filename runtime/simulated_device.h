// runtime/simulated_device.h — the simulated device (--device sim): the cuda
// backend's execution model run on the CPU, so that the engine's and the
// model's waits are tested without a GPU (notes/15-streams.md).
//
// What it models. Three streams (compute, comm, copy), each a queue run in
// order; copies, fills, loops and products are asynchronous on their stream;
// record / wait / query / synchronize have CUDA's meaning (an event stands
// for the work its stream had queued when it was recorded; a wait stands for
// the event's latest record; an event never recorded is complete). The work
// itself is the cpu backend's: the same loops, the same sgemm, so a correct
// program gives --device cpu's bits.
//
// How it is adversarial, deterministically:
//   - late: nothing runs until the host must see it. synchronize(s) runs s's
//     queue and only what s waits for (and what that waits for); query()
//     answers "not yet" once and then runs what the event stands for;
//     synchronize_all runs everything. Of what must run, the head that may
//     run and was queued last runs first (so of two unordered operations the
//     later-asked one runs first: a reader before the writer it forgot to
//     wait for, an overwrite before the read it forgot), even where the
//     queues' order would have run the earlier one first (a stream forced
//     through a wait runs the waited-for stream's work before its own).
//   - poisoned: a copy's or fill's destination holds NaN bits (0xff) from the
//     moment it may start (its stream's earlier work done, its waits met)
//     until it has run, so reading it early changes the bits;
//   - reported: when an operation runs while another stream's head is in
//     flight and their known bytes (copies, fills, products) conflict, that is
//     a race (neither is ordered before the other): both are named, with
//     their streams and where they were asked for, and every rank stops
//     (or, while a SimRaceLog is alive, the race is kept there: below).
//
// Device memory is the host's memory, but closed to the host: the pages of
// every device buffer (the arena's block, each direct allocation, each
// caching segment) are PROT_NONE except while the simulated device runs an
// operation or poisons a destination, so a host read or write of device
// memory — an illegal access on a GPU, where only Compute::copy reaches it —
// stops every rank with a message and the host's call stack. Pinned and
// pageable host memory stay open.
//
// What it leaves out: NCCL (--comm nccl is refused: a stand-in over MPI would
// need the device to progress while the host blocks in MPI, which a
// scheduler run by the host cannot do); the bytes a loop (Z2_LOOP) touches
// are not known, so its races show as changed bits, not as a report.
//
// Z2_SIM_SCHEDULE=seed:N runs, before each forced operation, other runnable
// heads in an order drawn from N (randomised interleavings; the default is
// "late"). Z2_SIM_SKIP=FILE:LINE[,FILE:LINE] makes the record, wait or
// synchronize asked for at those lines do nothing (the mutation test,
// tests/cli/streams.sh): at exit rank 0 says how often each was skipped.
// Z2_SIM_COUNT=1: at exit rank 0 says how often each site was asked for
// (which sites a run reaches: the mutation test's configs).
#pragma once

#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "zero2.h"

namespace z2 {

// An event on sim: which stream it was recorded on, and how many of that
// stream's operations it stands for (0: never recorded, complete).
struct SimEvent {
  int stream = -1;
  long through = 0;
  long polled_at = -1;  // the record a query said "not yet" to (it answers so once per record)
};

// The bytes [begin, end) an operation reads or writes.
struct ByteRange {
  const char* begin = nullptr;
  const char* end = nullptr;
  bool overlaps(const ByteRange& other) const { return begin < other.end && other.begin < end; }
};

struct SimOperation {
  std::string what;  // "copy 4,096 bytes", "fill 512 bytes", "loop", "gemm", "wait"
  Site site;
  long number = 0;  // its place in its stream's queue, from 1
  long asked = 0;   // its place among everything the host asked for
  std::function<void()> run;
  std::vector<ByteRange> reads, writes;  // known access sets; empty for a loop
  bool poison = false;                   // its writes read as NaN until it ran
  bool started = false;                  // it may run: its stream's earlier work is done, its waits met
  int wait_stream = -1;                  // a wait: for wait_stream's first wait_through operations
  long wait_through = 0;
  Work work;                             // what the timeline's model charges (runtime/timeline.h)
};

// While one is alive, a race found by this process's simulated devices is
// kept here instead of stopping every rank, and the work goes on in the
// scheduler's order. For a grader (the streams lab, tests/test_labs.cpp)
// that names the mistake behind a race and lets the ranks agree before any
// stops. One at a time.
struct SimRaceLog {
  SimRaceLog();
  ~SimRaceLog();
  SimRaceLog(const SimRaceLog&) = delete;
  SimRaceLog& operator=(const SimRaceLog&) = delete;
  long races = 0;     // how many were found
  std::string first;  // the first one's message
};

class SimulatedDevice {
 public:
  static constexpr int streams = 3;  // compute, comm, copy: Stream::handle is the number + 1
  explicit SimulatedDevice(Compute& compute);
  ~SimulatedDevice();

  void enqueue(int stream, SimOperation operation);
  void record(SimEvent& event, int stream, Site site);
  void wait(int stream, const SimEvent& event, Site site);
  bool query(SimEvent& event, Site site);
  void synchronize(int stream, Site site);
  void synchronize_all(Site site);
  // The operations still queued (~Compute runs them before its memory goes), and those
  // ever queued on `stream` (where the timeline starts counting).
  long pending() const;
  // Device memory: whole pages closed to the host (map: zeroed when new; a
  // reused one keeps its bytes until take()'s queued fill), given back
  // (unmap); or a block the allocator mapped itself (adopt, before it is
  // used; forget, before it is unmapped).
  void* map_memory(size_t bytes);
  void unmap_memory(void* pointer);
  void adopt_memory(void* block, size_t bytes);
  void forget_memory(void* block);
  // Whether device memory is closed to the host outside the device's work
  // (the default), for every simulated device of this process. Closing and opening it costs two mprotect calls an entry
  // point; the doctest suite's tens of thousands of tiny operations made that
  // 5 s of a 15 s run, so its harness keeps the memory open (the trainer's runs in
  // tests/cli, and tests/sim_check.cpp, check the rule).
  void set_memory_closed(bool closed);
  // Device memory as it is now, read without running anything: for a
  // grader that asks what has run so far (the streams lab), not for a program.
  void peek(void* host, const void* device, size_t bytes);
  long queued(int stream) const { return queued_[stream]; }
  static const char* stream_name(int stream);

 private:
  bool skipped(const Site& site);
  void finish_through(int stream, long through);
  void run_head(int stream);  // run_one, then start what may start
  void run_one(int stream);
  void start_heads();
  void run_needed(const long* need);
  int latest_runnable_head(const long* need);
  void check_race(const SimOperation& running, int stream) const;
  void interleave();
  // Device memory is open to the host's code only inside an entry point
  // (enqueue, query, synchronize...) that runs or poisons an operation.
  struct Entry {
    SimulatedDevice& device;
    explicit Entry(SimulatedDevice& d);
    ~Entry();
  };
  void open_memory();
  void protect(int protection);
  Compute& compute_;
  // Device memory is the process's (every simulated device's buffers are
  // opened and closed together), so these are too:
  static int entries_;          // entry points under way (a destructor may enter inside another)
  static bool memory_open_;     // the device's pages are readable and writable now
  static bool memory_closed_;   // set_memory_closed: closed again when the last entry point ends
  std::deque<SimOperation> queues_[streams];
  long queued_[streams] = {};    // operations ever queued on each stream
  long finished_[streams] = {};  // of them, finished (a prefix: streams run in order)
  long asked_ = 0;
  std::vector<std::pair<std::string, long>> skips_;  // Z2_SIM_SKIP's sites, and how often each was skipped
  bool counting_ = false;                            // Z2_SIM_COUNT: every site asked for, counted
  std::map<std::string, long> asked_at_;             // file:line -> how often (printed at exit)
  bool seeded_ = false;
  std::mt19937_64 random_;
};

}  // namespace z2
