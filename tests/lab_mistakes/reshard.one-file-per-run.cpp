// expect: so it takes a read from each
// A planted mistake for the reshard lab: each run read from the file its first element is in.
#include "zero2.h"
std::vector<z2::ReshardRead> z2::reshard_reads(const std::vector<StateRun>& owned, const std::vector<StateRun>& files) {
  std::vector<ReshardRead> reads;
  size_t into = 0;
  for (const StateRun& run : owned) {
    for (size_t q = 0; q < files.size(); ++q)
      if (files[q].canonical <= run.canonical && run.canonical < files[q].canonical + files[q].length) {
        const size_t length = std::min(run.length, files[q].canonical + files[q].length - run.canonical);
        reads.push_back({q, run.canonical, length, into});
      }
    into += run.length;
  }
  return reads;
}
