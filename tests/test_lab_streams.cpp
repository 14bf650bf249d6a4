// tests/test_lab_streams.cpp — the streams lab's graders (notes/labs/streams):
// checkpoint_copy, the record and wait around an activation checkpoint's copy,
// graded on the simulated device by a probe of one call and by BERT-mini's
// --activations offload bits. Beside the other labs' graders (tests/test_labs.cpp),
// in a file of its own: it is the one lab graded by the streams' order.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../runtime/simulated_device.h"
#include "harness.h"

using harness::lab_verdict;

// --- streams -----------------------------------------------------------------------------
// Graded on the simulated device (runtime/simulated_device.h): its streams run
// as late as the host lets them, a copy's destination reads as NaN from when
// the copy may start until it has run, and two operations in flight on two
// streams that touch the same bytes are a race, kept here (SimRaceLog) to be
// named instead of stopping every rank.

namespace {

// One call of checkpoint_copy on a simulated device of its own, after a
// write the grader queued on the compute stream (the checkpoint forward
// wrote), then one of the two orders a GPU may take next.
struct CopyProbe {
  std::string failed;          // the student's call threw: its message
  long races = 0;              // what the simulated device found
  std::string race;            //   (the first race's message)
  bool arrived = false;        // the bytes read at the end are those the compute stream wrote
  bool compute_ran = false;    // the call itself made the host run the compute stream's write
  bool copy_ran = false;       //   ... and the copy
  int ready_stream = -1, copied_stream = -1;  // where each event was recorded (-1: never)
};

enum class AfterTheCall {
  copy_runs_first,  // the copy engine is idle: the host forces the copy stream (its waits, nothing more)
  compute_reads,    // the compute stream waits for `copied`, then reads the destination
};

CopyProbe probe_checkpoint_copy(AfterTheCall next) {
  CopyProbe probe;
  z2::SimRaceLog log;  // outlives the device, which runs what is left when it goes
  {
    z2::Compute compute(z2::Device::sim);
    const size_t n = 96, bytes = n * sizeof(float);
    std::vector<float> written(n);
    for (size_t i = 0; i < n; ++i) written[i] = harness::test_value(i, 0x57);
    auto* source = (float*)compute.allocate(bytes, z2::MemoryKind::activations);
    auto* destination = (float*)compute.allocate(bytes, z2::MemoryKind::activations);
    auto* read_back = (float*)compute.allocate(bytes, z2::MemoryKind::activations);
    z2::Event ready = compute.create_event(), copied = compute.create_event();
    compute.synchronize_all();  // the allocations' zero fills: done before the probe starts
    // The grader looks at device memory as it is (the host may not read it:
    // the simulated device keeps it closed outside its operations).
    auto holds = [&](const float* buffer) {
      std::vector<float> now(n);
      compute.simulated()->peek(now.data(), buffer, bytes);
      return std::memcmp(now.data(), written.data(), bytes) == 0;
    };
    auto stream_of = [](z2::Event event) { return ((z2::SimEvent*)event.handle)->stream; };
    // The checkpoint, written on the compute stream (queued: nothing runs yet).
    compute.copy(source, written.data(), bytes, compute.compute_stream());
    try {
      z2::checkpoint_copy(compute, destination, source, bytes, ready, copied);
    } catch (const std::exception& error) {
      probe.failed = error.what();
    }
    probe.compute_ran = holds(source), probe.copy_ran = holds(destination);
    probe.ready_stream = stream_of(ready), probe.copied_stream = stream_of(copied);
    if (next == AfterTheCall::copy_runs_first) {
      compute.synchronize(compute.copy_stream());
      probe.arrived = holds(destination);
    } else {
      compute.wait(compute.compute_stream(), copied);
      compute.copy(read_back, destination, bytes, compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      probe.arrived = holds(read_back);
    }
    compute.synchronize_all();
    compute.destroy_event(ready), compute.destroy_event(copied);
    compute.release(read_back), compute.release(destination), compute.release(source);
  }
  probe.races = log.races, probe.race = log.first;
  return probe;
}

const char* stream_name(int stream) { return z2::SimulatedDevice::stream_name(stream); }

// What went wrong in a probe that failed, for the grader's line.
std::string what_the_probe_saw(const CopyProbe& probe) {
  if (probe.races > 0) return " (the simulated device reported: " + probe.race + ")";
  return " (no race was reported, but the bytes read were not the checkpoint's: NaN bits, from a copy still to run)";
}

}  // namespace

TEST_CASE("lab streams: checkpoint_copy orders its copy after the compute stream's work and marks its end") {
  std::string message;
  const CopyProbe first = probe_checkpoint_copy(AfterTheCall::copy_runs_first);
  const CopyProbe reads = probe_checkpoint_copy(AfterTheCall::compute_reads);
  if (!first.failed.empty() || !reads.failed.empty()) {
    message = "streams: checkpoint_copy stopped with: " + (first.failed.empty() ? reads.failed : first.failed);
  } else if (first.races > 0 || !first.arrived) {
    message = "streams: with the copy stream run first (a GPU may: its copy engine is idle), the copy read the "
              "checkpoint before the compute stream's write of it had run" + what_the_probe_saw(first) + ". ";
    if (first.ready_stream < 0)
      message += "Nothing ordered the copy: no wait at all (`ready` was never recorded). Record `ready` on the "
                 "compute stream and make the copy stream wait for it before the copy";
    else if (first.ready_stream != 0)
      message += std::string("`ready` was recorded on the ") + stream_name(first.ready_stream) +
                 " stream: it stands for that stream's work, not the compute stream's. Record it on the compute "
                 "stream, and make the copy stream wait for it";
    else
      message += "`ready` was recorded on the compute stream, but the copy stream never waited for it: the wait "
                 "is missing or went to the wrong stream (a stream that waits for its own event waits for "
                 "nothing). compute.wait(copy stream, ready), before the copy";
  } else if (reads.races > 0 || !reads.arrived) {
    message = "streams: the compute stream waited for `copied`, then read the copy's destination, and found the "
              "copy still to run" + what_the_probe_saw(reads) + ". ";
    if (reads.copied_stream < 0) {
      message += "`copied` was never recorded, and an event never recorded counts as complete: a wait for it "
                 "waits for nothing";
      if (reads.compute_ran && !reads.copy_ran)
        message += ". Your call synchronized the compute stream instead: the host waited for the compute "
                   "stream's work, but the copy is on the copy stream, and the host did not wait for it (nor "
                   "should it: record `copied` on the copy stream, after the copy)";
      else
        message += ". Record it on the copy stream, after the copy";
    } else if (reads.copied_stream != 2) {
      message += std::string("`copied` was recorded on the ") + stream_name(reads.copied_stream) +
                 " stream: it stands for that stream's work, not the copy. Record it on the copy stream, after "
                 "the copy";
    } else {
      message += "`copied` was recorded on the copy stream before the copy was queued: an event stands for the "
                 "work its stream had queued when it was recorded. Record it after the copy";
    }
  } else if (first.compute_ran || reads.compute_ran) {
    message = "streams: the bits are right, but checkpoint_copy made the host wait (a synchronize): while it "
              "waits it queues nothing, so the copy overlaps no compute. Let the streams wait for each other "
              "(record, then wait), not the host";
  }
  CHECK_MESSAGE(lab_verdict(message.empty(), message), message);
}

TEST_CASE("lab streams: BERT-mini with --activations offload on the simulated device trains keep's bits, no race") {
  // The model's offload and prefetch call checkpoint_copy for every
  // checkpoint; the compute stream waits for `copied` before it reads a
  // checkpoint or lets its slot go. The reference: --activations keep on
  // cpu, where no checkpoint travels and every operation runs when asked.
  const int N = harness::world_size();
  const std::vector<std::string> model = {"--layers", "3", "--hidden", "8", "--heads", "2", "--intermediate", "16",
                                          "--seq", "10", "--max-positions", "12", "--micro-batch", "4",
                                          "--steps", "2", "--warmup", "1", "--accum", std::to_string(4 / N),
                                          "--stage", "2", "--comm", "mpi"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), model.begin(), model.end());
    return flags;
  };
  const std::string reference = harness::bert_run_bits(with({"--device", "cpu", "--activations", "keep"}));
  std::string message;  // this rank's first finding (every rank runs both: bert::train is collective)
  // The arena reuses a checkpoint's slot for the next block's buffers; naive
  // zeroes each fresh slot on the compute stream: each finds other mistakes.
  for (const std::string alloc : {"arena", "naive"}) {
    z2::SimRaceLog log;
    const std::string bits =
        harness::bert_run_bits(with({"--device", "sim", "--activations", "offload", "--alloc", alloc}));
    const std::string run = "streams: BERT-mini (3 layers, stage 2, N = " + std::to_string(N) +
                            ") with --activations offload --alloc " + alloc + " on the simulated device: ";
    if (!message.empty()) continue;
    if (log.races > 0)
      message = run + "a race (" + std::to_string(log.races) + " in all; the first: " + log.first + ")";
    else if (harness::rank() == 0 && (bits.empty() || bits != reference))
      message = run + (bits.empty() ? std::string("the run failed")
                                    : "final parameters' hash and loss bits " + bits + ", --activations keep on cpu "
                                      "gives " + reference + ": a checkpoint's bytes were read before its copy had run, or "
                                      "copied before they were written");
  }
  CHECK_MESSAGE(lab_verdict(message.empty(), message), message);
}
