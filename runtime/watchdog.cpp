// runtime/watchdog.cpp — the watchdog (--timeout; README, "When something
// goes wrong"): every wait of the engine and the trainer polls against a
// deadline, and the rank whose deadline passes first holds a roll call
// before it ends the job. Host code.
#include "zero2.h"
#include "runtime/timeline.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>
#if defined(Z2_HAVE_NCCL)
#include <nccl.h>
#endif

namespace z2 {

// Every wait polls against a deadline. The rank whose deadline passes first
// holds a roll call before it ends the job: it asks every other rank, by a
// point-to-point message on MPI_COMM_WORLD (its own tags: the engine's
// traffic is on duplicated communicators), what that rank is waiting for. A
// rank that is itself waiting answers within a poll; one that is stopped,
// stuck in a kernel or dead does not answer, and that is how the message can
// name the ranks that have not arrived even for a collective, where MPI
// itself says nothing about who is missing. This is PyTorch's idea (its
// process-group watchdog dumps every rank's last collective) without a
// separate store: the world communicator carries it.

namespace {
double watchdog_seconds = 600;
std::string watchdog_where;
std::vector<void*> nccl_to_abort;  // ncclComm_t of the live Communicators
using Clock = std::chrono::steady_clock;

constexpr int roll_call_tag = 0x7a32;    // "who is where?": the asker's rank, one int
constexpr int roll_answer_tag = 0x7a33;  // the answer: one line of text
constexpr int answer_chars = 320;

// What this rank waits for now (null between waits), and since when.
const std::function<std::string()>* current_wait = nullptr;
Clock::time_point current_wait_began;
Clock::time_point last_roll_call_probe;
int roll_call_by = -1;  // the first rank whose roll call this rank answered: it is ending the job

Clock::duration seconds(double count) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(count));
}
double seconds_since(Clock::time_point moment) { return std::chrono::duration<double>(Clock::now() - moment).count(); }
int world_rank() {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// One line: what this rank waits for, in which step, for how long.
std::string where_this_rank_is() {
  char text[answer_chars];
  if (current_wait == nullptr) {
    snprintf(text, sizeof text, "is not waiting (computing)%s%s", watchdog_where.empty() ? "" : ", in ",
             watchdog_where.c_str());
  } else {
    snprintf(text, sizeof text, "has waited %.1f s for %s%s%s", seconds_since(current_wait_began),
             (*current_wait)().c_str(), watchdog_where.empty() ? "" : ", in ", watchdog_where.c_str());
  }
  return text;
}

// Answer every roll call that has come (at most every 10 ms: polls are
// hot). The answer's buffer must outlive its send, and the job ends
// soon after any roll call, so answers are kept, never reused.
void answer_roll_calls(bool now_and_then = true) {
  const Clock::time_point now = Clock::now();
  if (now_and_then && now - last_roll_call_probe < std::chrono::milliseconds(10)) return;
  last_roll_call_probe = now;
  static std::deque<std::vector<char>> answers;
  for (;;) {
    int pending = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, roll_call_tag, MPI_COMM_WORLD, &pending, &status);
    if (!pending) return;
    int asker = -1;  // the same as status.MPI_SOURCE; received to take the message off the queue
    MPI_Recv(&asker, 1, MPI_INT, status.MPI_SOURCE, roll_call_tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    const std::string line = where_this_rank_is();
    answers.emplace_back(line.begin(), line.end());
    answers.back().push_back('\0');
    MPI_Request request;
    MPI_Isend(answers.back().data(), (int)answers.back().size(), MPI_CHAR, status.MPI_SOURCE, roll_answer_tag,
              MPI_COMM_WORLD, &request);
    MPI_Request_free(&request);
    // Quiet: the asker prints this answer. If this rank's own deadline
    // passes too, it says one line and leaves the report to the asker.
    if (roll_call_by < 0) roll_call_by = status.MPI_SOURCE;
  }
}

// Ask every other rank where it is; wait for the answers at most `grace`
// seconds (answering the others' roll calls meanwhile: they may have
// expired too). Returns one line per rank, "" for a rank that did not answer.
std::vector<std::string> roll_call(double grace) {
  const int rank = world_rank(), size = world_size();
  // Static: a rank that answers late writes into its receive after we stop
  // waiting (the job ends before anything else could use the memory).
  static std::vector<std::vector<char>> answers;
  static std::vector<MPI_Request> receives;
  answers.assign(size, std::vector<char>(answer_chars, '\0'));
  receives.assign(size, MPI_REQUEST_NULL);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    static int asker;  // a send's buffer must outlive it, and freed sends are not waited for
    asker = rank;
    MPI_Request send;
    MPI_Isend(&asker, 1, MPI_INT, peer, roll_call_tag, MPI_COMM_WORLD, &send);
    MPI_Request_free(&send);
    MPI_Irecv(answers[peer].data(), answer_chars, MPI_CHAR, peer, roll_answer_tag, MPI_COMM_WORLD, &receives[peer]);
  }
  std::vector<std::string> lines(size);
  std::vector<bool> answered(size, false);
  answered[rank] = true;
  const Clock::time_point deadline = Clock::now() + seconds(grace);
  for (;;) {
    bool all = true;
    for (int peer = 0; peer < size; ++peer) {
      if (answered[peer]) continue;
      int done = 0;
      MPI_Test(&receives[peer], &done, MPI_STATUS_IGNORE);
      if (done) {
        answered[peer] = true;
        answers[peer].back() = '\0';
        lines[peer] = answers[peer].data();
      } else {
        all = false;
      }
    }
    if (all || Clock::now() > deadline) break;
    answer_roll_calls();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return lines;
}
}  // namespace

void set_watchdog_timeout(double timeout) {
  if (!(timeout >= 1) || !std::isfinite(timeout)) usage_error("--timeout %g: a number of seconds >= 1", timeout);
  watchdog_seconds = timeout;
}
double watchdog_timeout() { return watchdog_seconds; }
void set_watchdog_context(const std::string& where) { watchdog_where = where; }

[[noreturn]] void watchdog_expired(const std::string& waited_for) {
  const int rank = world_rank(), size = world_size();
  // A tenth of the timeout, 1 to 10 s: waiting ranks answer within 10 ms;
  // one busy computing gets a moment to reach its next wait.
  const double grace = std::min(10.0, std::max(1.0, watchdog_seconds / 10));
  // Another rank's roll call already under way: it reports and ends the
  // job; this rank says where it is in one line and keeps answering. (If
  // that rank dies before ending the job, this one holds its own roll call.)
  answer_roll_calls(false);
  if (roll_call_by >= 0) {
    fprintf(stderr, "[zero2] rank %d of %d: watchdog: waited %g s for %s%s%s; rank %d's roll call is ending the job\n",
            rank, size, watchdog_seconds, waited_for.c_str(), watchdog_where.empty() ? "" : ", in ",
            watchdog_where.c_str(), roll_call_by);
    fflush(stderr);
    const Clock::time_point give_up = Clock::now() + seconds(grace + 2);
    while (Clock::now() < give_up) {
      answer_roll_calls();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  const std::vector<std::string> lines = roll_call(grace);
  std::string silent, report;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    if (lines[peer].empty()) silent += (silent.empty() ? "" : ", ") + std::to_string(peer);
    else report += "[zero2]   rank " + std::to_string(peer) + " " + lines[peer] + "\n";
  }
  const std::string verdict =
      silent.empty() ? "every rank answered, so none is stopped: they wait for different things (below): a lock "
                       "another process holds, collectives called in a different order on some rank, or a "
                       "message the network lost"
      : silent.find(',') == std::string::npos
          ? "rank " + silent + " did not answer: it is stopped, stuck or dead (or the network is)"
          : "ranks " + silent + " did not answer: they are stopped, stuck or dead (or the network is)";
  fprintf(stderr,
          "[zero2] rank %d of %d: watchdog: waited %g s for %s%s%s: ending the job (--timeout SECONDS sets the "
          "limit)\n[zero2]   roll call (%g s): %s\n%s",
          rank, size, watchdog_seconds, waited_for.c_str(), watchdog_where.empty() ? "" : ", in ",
          watchdog_where.c_str(), grace, verdict.c_str(), report.c_str());
  fflush(stderr);
#if defined(Z2_HAVE_NCCL)
  // Kernels waiting for a peer would never finish: abort them first.
  for (void* comm : nccl_to_abort) ncclCommAbort((ncclComm_t)comm);
#endif
  // MPI_Abort has mpirun kill every rank at once, and what a rank last wrote
  // can be lost on its way to mpirun's stderr: give the message a moment.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

// Poll `done` (true once the waited-for thing has happened) until it is, or
// the deadline passes; answer the roll calls of ranks whose deadline passed.
// We yield between polls: ranks often share cores, and the rank we wait
// for needs the CPU.
// --timeline on sim: the clock a wait stops (runtime/timeline.h).
static Timeline* waiting_clock = nullptr;
void set_waiting_clock(Timeline* timeline) { waiting_clock = timeline; }

void wait_until(const std::function<bool()>& done, const std::function<std::string()>& describe) {
  const HostClockPaused paused(waiting_clock);
  if (done()) return;
  const Clock::time_point began = Clock::now(), deadline = began + seconds(watchdog_seconds);
  struct Waiting {  // what a roll call answers; cleared however the wait ends (done() may throw)
    Waiting(const std::function<std::string()>& describe, Clock::time_point began) {
      current_wait = &describe;
      current_wait_began = began;
    }
    ~Waiting() { current_wait = nullptr; }
  } waiting(describe, began);
  while (!done()) {
    if (Clock::now() > deadline) watchdog_expired(describe());
    answer_roll_calls();
    std::this_thread::yield();
  }
}

void wait_request(MPI_Request* request, const std::string& what) {
  wait_until(
      [&] {
        int done = 0;
        Z2_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
        return done != 0;
      },
      [&] { return what; });
}

void watched_allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                       const std::string& what) {
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Iallreduce(send, receive, count, type, op, comm, &request));
  wait_request(&request, what);
}

void watched_bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm, const std::string& what) {
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Ibcast(buffer, count, type, root, comm, &request));
  wait_request(&request, what);
}

void watch_nccl_communicator(void* comm) { nccl_to_abort.push_back(comm); }
void unwatch_nccl_communicator(void* comm) {
  nccl_to_abort.erase(std::find(nccl_to_abort.begin(), nccl_to_abort.end(), comm));
}

}  // namespace z2
