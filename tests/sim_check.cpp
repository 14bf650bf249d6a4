// tests/sim_check.cpp — the simulated device's own rules, one small stream
// program per case, each run by tests/cli/sim_device.sh, which checks what
// it prints or how it stops (the rules: runtime/simulated_device.h).
//   mpirun -n N build/sim_check CASE
//     ordered      a copy up on the copy stream, a loop on compute that waits
//                  for it, a copy down: prints the values (2 4 6 8)
//     no-wait      the same without the wait: the loop reads the poisoned
//                  destination (prints nan)
//     host-early   the host reads a copy's destination before synchronizing
//                  (not 2 4 6 8: the copy has not run)
//     source-late  the host rewrites a copy's source before the copy ran
//                  (prints the new values: the copy runs late)
//     race         a fill on comm and a copy on copy into the same bytes, no
//                  event: stops every rank naming both, their streams and lines
//     host-read    the host reads device memory: stops every rank
//     host-read-freed  the same after the buffer was released
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../zero2.h"

namespace {

const size_t count = 4;

// One line, written whole: the ranks' lines share one pipe.
void print(const char* label, const float* values) {
  std::string line = label;
  char number[32];
  for (size_t i = 0; i < count; ++i) snprintf(number, sizeof number, " %g", values[i]), line += number;
  line += "\n";
  fputs(line.c_str(), stdout);
  fflush(stdout);
}

// A copy up on the copy stream, a loop on compute that doubles it (waiting
// for the copy or not), a copy down, and the host's view of the result.
void doubled(z2::Compute& compute, bool wait_for_copy, bool read_early, bool rewrite_source) {
  float* pinned = (float*)compute.allocate_host_pinned(count * sizeof(float));
  float* result = (float*)compute.allocate_host_pinned(count * sizeof(float));
  float* device = (float*)compute.allocate(count * sizeof(float), z2::MemoryKind::bookkeeping);
  float* twice = (float*)compute.allocate(count * sizeof(float), z2::MemoryKind::bookkeeping);
  for (size_t i = 0; i < count; ++i) pinned[i] = (float)(i + 1);
  z2::Event copied = compute.create_event();
  compute.copy(device, pinned, count * sizeof(float), compute.copy_stream());
  compute.record(copied, compute.copy_stream());
  if (rewrite_source)  // the copy has not run: it will read these
    for (size_t i = 0; i < count; ++i) pinned[i] = 10.0f * (float)(i + 1);
  if (wait_for_copy) compute.wait(compute.compute_stream(), copied);
  compute.for_each(count, Z2_LOOP(i, { twice[i] = 2.0f * device[i]; }));
  compute.copy(result, twice, count * sizeof(float), compute.compute_stream());
  if (read_early) print("early:", result);  // before the synchronize below
  compute.synchronize(compute.compute_stream());
  if (!read_early) print("result:", result);
  compute.synchronize_all();
  compute.destroy_event(copied);
  compute.release(twice);
  compute.release(device);
  compute.release_host_pinned(result);
  compute.release_host_pinned(pinned);
}

void race(z2::Compute& compute) {
  float* pinned = (float*)compute.allocate_host_pinned(count * sizeof(float));
  float* device = (float*)compute.allocate(count * sizeof(float), z2::MemoryKind::bookkeeping);
  compute.fill_zero(device, count * sizeof(float), compute.comm_stream());
  compute.copy(device, pinned, count * sizeof(float), compute.copy_stream());  // no event orders it after the fill
  compute.synchronize_all();
  printf("no race reported\n");
}

void host_read(z2::Compute& compute, bool after_release) {
  float* device = (float*)compute.allocate(count * sizeof(float), z2::MemoryKind::bookkeeping);
  if (after_release) compute.release(device);  // a use after free, on the device
  volatile float value = device[1];            // what a GPU would refuse
  printf("read %g from device memory\n", (double)value);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string which = argc == 2 ? argv[1] : "";
  int status = 0;
  {
    z2::Compute compute(z2::Device::sim);
    if (which == "ordered") doubled(compute, true, false, false);
    else if (which == "no-wait") doubled(compute, false, false, false);
    else if (which == "host-early") doubled(compute, true, true, false);
    else if (which == "source-late") doubled(compute, true, false, true);
    else if (which == "race") race(compute);
    else if (which == "host-read") host_read(compute, false);
    else if (which == "host-read-freed") host_read(compute, true);
    else {
      if (rank == 0)
        fprintf(stderr, "usage: %s ordered|no-wait|host-early|source-late|race|host-read|host-read-freed\n", argv[0]);
      status = 2;
    }
  }
  fflush(stdout);
  MPI_Finalize();
  return status;
}
