// runtime/timeline.h — the timeline (the trainer's --timeline FILE): every
// stream operation of a run as a slice on its stream's track, the host's
// collectives by bucket, the host's waits and the streams' waits, written as
// Chrome trace-event JSON (it opens in ui.perfetto.dev and chrome://tracing;
// notes/15-streams.md, "The timeline"). Machinery, not a chapter: Compute
// (runtime/compute.cpp) and the simulated device call it; the engine marks
// where a bucket's transfer starts and where it ends, one line each.
//
// Where the times come from, by backend:
//   cpu:  the host's clock. Every operation runs at once on the host, so a
//         slice is the time the host spent in it.
//   cuda: cudaEvents with timing, recorded around every operation while the
//         timeline is on and read at the end (unmeasured: no GPU has run it).
//   sim:  a model, in virtual device time. The simulated device runs its
//         operations late, inline on the host thread, in an adversarial order,
//         so real time says nothing about a device. Instead each operation gets
//         a modelled duration (modelled_seconds, below) and starts at the latest
//         of: its stream's previous end, the end of what its stream's waits
//         stand for, and the host's virtual time when it was asked for. The
//         host's virtual time is its real time spent outside the simulated
//         device (so ZeRO-Offload's host step shows), and at a synchronize,
//         or a query that says yes, the host waits until the stream's virtual
//         end. None of this depends on the order in which the scheduler really
//         runs the operations. MPI is modelled too: a wait for another rank
//         stops the host's clock (its real length is mostly the other rank's
//         CPU running its own simulated device, which is no device's time),
//         and a collective's messages arrive no earlier than their post plus
//         the network's latency and their bytes at its bandwidth.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "zero2.h"

namespace z2 {

// The cost model of --device sim: an H200-like device, stated as constants.
// They are a model, not a measurement (nothing here has been timed on an
// H200); they set the proportions of a picture, not a prediction.
struct CostModel {
  static constexpr double launch = 4e-6;               // s: a kernel's or a copy's launch and latency
  static constexpr double memory_bandwidth = 4.8e12;   // B/s: HBM3e, H200's datasheet figure
  static constexpr double host_link_bandwidth = 50e9;  // B/s: a pinned copy over PCIe 5 x16, what one sees of 64
  static constexpr double loop_rate = 300e9;           // elements/s: a loop reads and writes ~12 bytes an element
  static constexpr double fp32_gemm_rate = 50e12;      // flop/s: fp32 without tensor cores (67 peak)
  static constexpr double tensor_gemm_rate = 600e12;   // flop/s: bf16/fp16 on tensor cores (989 dense peak)
  static constexpr double network_latency = 5e-6;      // s: an MPI message between two nodes
  static constexpr double network_bandwidth = 50e9;    // B/s: one 400 Gb/s InfiniBand link per GPU
};
// An operation's modelled seconds: a copy moves its bytes across the host
// link, or reads and writes them in device memory; a fill writes them; a
// product does 2 M N K flops per matrix; a loop touches its elements. Each
// pays one launch.
double modelled_seconds(const Work& work);

class Timeline {
 public:
  // Tracks (trace-event "threads") of one rank: the three streams by their
  // number, the host, and one per staging slot for the host-driven
  // collectives (a slot holds one bucket's transfer at a time, so its
  // spans never overlap; two slots in flight would overlap on one track).
  static constexpr int host_track = 3, first_slot_track = 4;
  // `queued`: on sim, the operations each stream had queued before the
  // timeline started (they count as done at time 0); else null.
  explicit Timeline(Device device, const long* queued = nullptr);
  Device device() const { return device_; }

  // --- the host's clock (seconds since the timeline started) ---
  double host_now() const;
  // Paused while the simulated device runs its operations or queues one
  // (nested pauses count once).
  void pause_host();
  void resume_host();
  // The host waits until `time` (sim): a slice on the host track says for what.
  void host_waits_until(double time, const std::string& for_what);

  // --- what is recorded ---
  // An operation's slice on `track` from `begin` to `end` (seconds), named
  // by what it does and who asked for it (a loop by its caller's function).
  void slice(int track, const Site& site, const Work& work, double begin, double end);
  // An arrow from a slice of `from_track` that holds `from` to the next slice
  // of `to_track` from `to` on (a stream's wait for an event of another).
  void flow(int from_track, double from, int to_track, double to);
  // A span that opens now and closes later (a collective, a training step):
  // its number, for close().
  long open(int track, const std::string& name, double begin, const std::string& category);
  void close(long span, double end);
  void move_begin(long span, double begin);  // cuda: its begin as the events say

  // --- on sim: the device modelled (called by the simulated device) ---
  // `stream`'s next operation was queued now: work (a slice) or, with
  // work.kind none, a wait's place in the queue (no time of its own).
  void sim_queued(int stream, const Site& site, const Work& work);
  // `stream` waits for the first `through` operations of `other`.
  void sim_waits(int stream, int other, long through);
  // The host waits for the first `through` operations of `stream`.
  void sim_host_waits(int stream, long through);
  // MPI posted now `bytes` of a collective: when they arrive (seconds). And
  // MPI said they did: the host has waited for `arrival` (for the network).
  double sim_posted(size_t bytes) const;
  void sim_arrived(double arrival) { host_waits_until(arrival, "the network"); }
  // When `stream` could start its next operation (the host aside).
  double sim_stream_end(int stream) const { return stream_end_[stream]; }

  // --- on cuda: operations timed by events (cudaEvent_t, timing enabled),
  // read at the end by Compute::finish_timeline, in seconds after `origin`.
  struct GpuSlice {
    int track;
    Site site;
    Work work;
    void *begin, *end;
    long span = -1;  // >= 0: the events are this open() span's ends instead (a collective)
  };
  void* gpu_origin = nullptr;
  std::vector<GpuSlice> gpu_slices;

  // This rank's events as JSON objects, comma-separated (pid = rank).
  std::string events_json(int rank) const;

 private:
  struct Slice {
    int track;
    std::string name, category;  // a span's; an operation's come from its site and work
    Site site;
    Work work;
    double begin, end;
  };
  struct Flow {
    int from_track, to_track;
    double from, to;
  };
  double done_by(int stream, long through) const;
  Device device_;
  double last_work_end(int stream, long through) const;
  std::chrono::steady_clock::time_point resumed_at_;
  double host_base_ = 0;  // the host's virtual seconds up to resumed_at_ (or up to the pause)
  int pauses_ = 0;
  std::vector<Slice> slices_;
  std::vector<Flow> flows_;
  // sim: per stream, the operations queued before the start, when the first
  // k since then are done (waits included), and the end of the last work among them.
  static constexpr int streams = 3;
  long base_[streams] = {};
  std::vector<double> done_[streams], work_end_[streams];
  double stream_end_[streams] = {};
};

// The host's clock stopped for a scope on sim (the simulated device at work,
// MPI's calls: their time is the model's); null, or another device: nothing.
struct HostClockPaused {
  Timeline* timeline;
  explicit HostClockPaused(Timeline* t) : timeline(t && t->device() == Device::sim ? t : nullptr) {
    if (timeline) timeline->pause_host();
  }
  ~HostClockPaused() {
    if (timeline) timeline->resume_host();
  }
  HostClockPaused(const HostClockPaused&) = delete;
  HostClockPaused& operator=(const HostClockPaused&) = delete;
};

// On sim, every wait_until (an MPI request, a transfer's step: what another
// rank holds up) stops `timeline`'s host clock while it polls; null: none
// (runtime/watchdog.cpp).
void set_waiting_clock(Timeline* timeline);

// The whole timeline file on rank 0 (every rank's events gathered over
// `world`; collective), "" on the others.
std::string timeline_json(Compute& compute, MPI_Comm world);

}  // namespace z2
