// runtime/timeline.cpp — the timeline's recorder (runtime/timeline.h says
// where its times come from): the cost model, the host's clock, the
// simulated device's modelled times, and the trace-event JSON, gathered
// from every rank to rank 0. Host code.
#include "runtime/timeline.h"

#include <algorithm>
#include <climits>

namespace z2 {

// --- the cost model (--device sim) ---------------------------------------------

double modelled_seconds(const Work& work) {
  const double n = work.amount;
  switch (work.kind) {
    case Work::Kind::none: return 0;
    case Work::Kind::loop: return CostModel::launch + n / CostModel::loop_rate;
    case Work::Kind::gemm_fp32: return CostModel::launch + n / CostModel::fp32_gemm_rate;
    case Work::Kind::gemm_16bit: return CostModel::launch + n / CostModel::tensor_gemm_rate;
    // A copy in device memory reads and writes every byte; one over the host
    // link is bound by the link alone.
    case Work::Kind::copy:
      return CostModel::launch + (work.host_link ? n / CostModel::host_link_bandwidth : 2 * n / CostModel::memory_bandwidth);
    case Work::Kind::fill: return CostModel::launch + n / CostModel::memory_bandwidth;
  }
  return 0;
}

// --- the host's clock ---------------------------------------------------------------

Timeline::Timeline(Device device, const long* queued) : device_(device), resumed_at_(std::chrono::steady_clock::now()) {
  for (int s = 0; s < streams; ++s) base_[s] = queued ? queued[s] : 0;
}

static double seconds_since(std::chrono::steady_clock::time_point then) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - then).count();
}

double Timeline::host_now() const { return pauses_ > 0 ? host_base_ : host_base_ + seconds_since(resumed_at_); }

void Timeline::pause_host() {
  if (pauses_++ == 0) host_base_ += seconds_since(resumed_at_);
}

void Timeline::resume_host() {
  if (--pauses_ == 0) resumed_at_ = std::chrono::steady_clock::now();
}

// The host blocked (a synchronize, a query that said yes) until the device
// got to `time`: its clock moves there, and the host track shows the wait.
void Timeline::host_waits_until(double time, const std::string& for_what) {
  const double now = host_now();
  if (time <= now) return;
  slices_.push_back({host_track, "waits for " + for_what, "host wait", Site{}, Work{}, now, time});
  host_base_ += time - now;
}

// --- what is recorded ---------------------------------------------------------------

void Timeline::slice(int track, const Site& site, const Work& work, double begin, double end) {
  slices_.push_back({track, "", "", site, work, begin, end});
}

void Timeline::flow(int from_track, double from, int to_track, double to) {
  flows_.push_back({from_track, to_track, from, to});
}

long Timeline::open(int track, const std::string& name, double begin, const std::string& category) {
  slices_.push_back({track, name, category, Site{}, Work{}, begin, begin});
  return (long)slices_.size() - 1;
}

void Timeline::close(long span, double end) {
  if (span >= 0 && span < (long)slices_.size()) slices_[span].end = std::max(end, slices_[span].begin);
}

void Timeline::move_begin(long span, double begin) {
  if (span >= 0 && span < (long)slices_.size()) slices_[span].begin = begin;
}

// --- on sim: the device modelled ------------------------------------------------------
// Per stream, done_[s][k] is when its first base + k + 1 operations are done
// (a wait's place counts: an event recorded after it stands for it too), and
// work_end_ the end of the last work among them, where a wait's arrow starts.

double Timeline::done_by(int stream, long through) const {
  const long k = through - base_[stream] - 1;
  if (k < 0) return 0;  // queued before the timeline started: done at its start
  return k < (long)done_[stream].size() ? done_[stream][k] : stream_end_[stream];
}

double Timeline::last_work_end(int stream, long through) const {
  const long k = through - base_[stream] - 1;
  if (k < 0 || k >= (long)work_end_[stream].size()) return -1;
  return work_end_[stream][k];
}

void Timeline::sim_queued(int stream, const Site& site, const Work& work) {
  if (work.kind == Work::Kind::none) {  // a wait's place: no time of its own
    done_[stream].push_back(stream_end_[stream]);
    work_end_[stream].push_back(work_end_[stream].empty() ? -1 : work_end_[stream].back());
    return;
  }
  const double begin = std::max(stream_end_[stream], host_now());
  const double end = begin + modelled_seconds(work);
  stream_end_[stream] = end;
  done_[stream].push_back(end);
  work_end_[stream].push_back(end);
  slice(stream, site, work, begin, end);
}

// A wait holds the stream's next operation until the awaited work's end; the
// arrow runs from the end of the last work the event stands for to where
// the waiting stream may go on. Both ends sit 10 ns early: inside that
// slice (which a viewer binds the arrow's start to) whatever the rounding
// to nanoseconds, and before the waiting stream's next slice (its end).
void Timeline::sim_waits(int stream, int other, long through) {
  if (other < 0 || other == stream || through <= base_[other]) return;
  stream_end_[stream] = std::max(stream_end_[stream], done_by(other, through));
  const double from = last_work_end(other, through), early = 10e-9;
  if (from > 0) flow(other, from - early, stream, stream_end_[stream] - early);
}

void Timeline::sim_host_waits(int stream, long through) {
  static const char* names[] = {"the compute stream", "the comm stream", "the copy stream"};
  if (through > base_[stream]) host_waits_until(done_by(stream, through), names[stream]);
}

double Timeline::sim_posted(size_t bytes) const {
  return host_now() + CostModel::network_latency + (double)bytes / CostModel::network_bandwidth;
}

// --- the JSON ---------------------------------------------------------------------

static std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') out += '\\', out += (char)c;
    else if (c < 0x20) out += format_text("\\u%04x", c);
    else out += (char)c;
  }
  return out + "\"";
}

// An operation's name: a loop by the function that asked for it, a product
// as a gemm there, a copy or a fill by its bytes.
static std::string operation_name(const Site& site, const Work& work) {
  const size_t n = (size_t)work.amount;
  switch (work.kind) {
    case Work::Kind::gemm_fp32:
    case Work::Kind::gemm_16bit: return std::string("gemm (") + site.function + ")";
    case Work::Kind::copy: return "copy " + with_commas(n) + " bytes" + (work.host_link ? " (host link)" : "");
    case Work::Kind::fill: return "fill " + with_commas(n) + " bytes";
    default: return site.function;
  }
}

static const char* category_of(const Work& work, int track) {
  if (track == Timeline::host_track) return "host loop";
  static const char* names[] = {"", "loop", "gemm", "gemm", "copy", "fill"};
  return names[(int)work.kind];
}

static std::string microseconds(double seconds) { return format_text("%.3f", seconds * 1e6); }

static std::string track_name(Device device, int track) {
  static const char* names[] = {"compute", "comm", "copy", "host"};
  if (track >= Timeline::first_slot_track) return "comm: slot " + std::to_string(track - Timeline::first_slot_track);
  if (device == Device::cpu && track == 0) return "cpu (every stream, at once)";
  return names[track];
}

// Tracks in the viewer's order: compute, comm, the slots' collectives under
// it, copy, host.
static int sort_index(int track) {
  return track == 0 ? 0 : track == 1 ? 1 : track >= Timeline::first_slot_track ? track - 2 : 1000 + track;
}

std::string Timeline::events_json(int rank) const {
  std::vector<std::string> events;
  const std::string pid = std::to_string(rank);
  events.push_back("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"name\":\"rank " + pid + "\"}}");
  events.push_back("{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"sort_index\":" + pid +
                   "}}");
  // The streams (one on cpu) and the host always; a slot's track once it holds a collective.
  std::vector<int> tracks = device_ == Device::cpu ? std::vector<int>{0, host_track} : std::vector<int>{0, 1, 2, host_track};
  for (const Slice& s : slices_)
    if (std::find(tracks.begin(), tracks.end(), s.track) == tracks.end()) tracks.push_back(s.track);
  for (int track : tracks) {
    const std::string tid = ",\"pid\":" + pid + ",\"tid\":" + std::to_string(track);
    events.push_back("{\"name\":\"thread_name\",\"ph\":\"M\"" + tid + ",\"args\":{\"name\":" +
                     quoted(track_name(device_, track)) + "}}");
    events.push_back("{\"name\":\"thread_sort_index\",\"ph\":\"M\"" + tid + ",\"args\":{\"sort_index\":" +
                     std::to_string(sort_index(track)) + "}}");
  }
  for (const Slice& s : slices_) {
    const bool operation = s.name.empty();
    std::string args = operation ? "\"site\":" + quoted(std::string(s.site.file) + ":" + std::to_string(s.site.line)) +
                                       ",\"function\":" + quoted(s.site.function)
                                 : "";
    if (operation && s.work.kind != Work::Kind::none)
      args += format_text(",\"%s\":%.0f", s.work.kind == Work::Kind::loop   ? "elements"
                                          : s.work.kind == Work::Kind::copy || s.work.kind == Work::Kind::fill ? "bytes"
                                                                                                              : "flops",
                          s.work.amount);
    events.push_back("{\"name\":" + quoted(operation ? operation_name(s.site, s.work) : s.name) +
                     ",\"cat\":" + quoted(operation ? category_of(s.work, s.track) : s.category) +
                     ",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + std::to_string(s.track) +
                     ",\"ts\":" + microseconds(s.begin) + ",\"dur\":" + microseconds(s.end - s.begin) + ",\"args\":{" +
                     args + "}}");
  }
  // A flow's two ends share an id, unique over the ranks.
  for (size_t k = 0; k < flows_.size(); ++k) {
    const Flow& f = flows_[k];
    const std::string id = std::to_string(((long long)rank << 32) + (long long)k);
    events.push_back("{\"name\":\"wait\",\"cat\":\"wait\",\"ph\":\"s\",\"id\":" + id + ",\"pid\":" + pid +
                     ",\"tid\":" + std::to_string(f.from_track) + ",\"ts\":" + microseconds(f.from) + "}");
    events.push_back("{\"name\":\"wait\",\"cat\":\"wait\",\"ph\":\"f\",\"id\":" + id + ",\"pid\":" + pid +
                     ",\"tid\":" + std::to_string(f.to_track) + ",\"ts\":" + microseconds(f.to) + "}");
  }
  std::string text;
  for (size_t k = 0; k < events.size(); ++k) text += (k ? ",\n" : "") + events[k];
  return text;
}

// What the times are, for the file's reader.
static const char* clock_of(Device device) {
  return device == Device::sim    ? "virtual device time: the simulated device's cost model (runtime/timeline.h)"
         : device == Device::cuda ? "cudaEvents on the GPU; host spans by the host's clock"
                                  : "the host's clock (every operation runs at once)";
}

std::string timeline_json(Compute& compute, MPI_Comm world) {
  compute.finish_timeline();
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  const std::string mine = compute.timeline() ? compute.timeline()->events_json(rank) : "";
  long long length = (long long)mine.size();
  std::vector<long long> lengths((size_t)size);
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Iallgather(&length, 1, MPI_LONG_LONG, lengths.data(), 1, MPI_LONG_LONG, world, &request));
  wait_request(&request, "the gather of the timeline's sizes");
  std::vector<int> counts, displacements;
  long long total = 0;
  for (long long n : lengths) counts.push_back((int)n), displacements.push_back((int)total), total += n;
  if (total > INT_MAX)  // every rank knows the sizes: every rank refuses alike
    usage_error("--timeline: the ranks' events take %s bytes, more than one MPI message holds: time fewer --steps",
                with_commas((size_t)total).c_str());
  std::string all(rank == 0 ? (size_t)total : 0, '\0');
  Z2_MPI_CHECK(MPI_Igatherv(mine.data(), (int)length, MPI_CHAR, all.data(), counts.data(), displacements.data(),
                            MPI_CHAR, 0, world, &request));
  wait_request(&request, "the gather of the timeline's events");
  if (rank != 0) return "";
  std::string text = "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"device\":" +
                     quoted(to_string(compute.device())) + ",\"times\":" + quoted(clock_of(compute.device())) +
                     "},\n\"traceEvents\":[\n";
  for (int r = 0; r < size; ++r)
    text += (r ? ",\n" : "") + all.substr((size_t)displacements[r], (size_t)counts[r]);
  return text + "\n]}\n";
}

}  // namespace z2
