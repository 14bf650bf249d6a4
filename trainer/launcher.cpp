// trainer/launcher.cpp — the launch checked (trainer/launcher.h): the
// environment's world against MPI's, and --local_rank against MPI's local
// rank. What each launcher sets was measured here (notes/07, "Launching"):
// MPICH's hydra gives every rank PMI_SIZE, PMI_RANK, PMI_FD,
// MPI_LOCALRANKID and MPI_LOCALNRANKS; a process started without it (bare,
// by torchrun, or with PMI_SIZE=2 but no PMI_FD) is an MPI singleton, a
// world of one rank, whatever the other variables say.
#include "trainer/launcher.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "zero2.h"

namespace bert {

LaunchFacts launch_facts(MPI_Comm world) {
  LaunchFacts facts;
  MPI_Comm_size(world, &facts.world_size);
  MPI_Comm_rank(world, &facts.rank);
  facts.local_rank = z2::local_rank_of(world);
  return facts;
}

// The variables other launchers give each process, by launcher: a size
// names the world, a rank r says there are at least r + 1 processes.
namespace {
struct Variable {
  const char* name;
  bool size;
};
struct Launcher {
  const char* who;                  // for the message
  std::vector<Variable> variables;  // in the order the message lists them
  const char* why;                  // why it gives no MPI world, and what does
};
const std::vector<Launcher>& launchers() {
  static const std::vector<Launcher> table = {
      {"torchrun or DeepSpeed's launcher",
       {{"WORLD_SIZE", true}, {"RANK", false}, {"LOCAL_RANK", false}, {"LOCAL_WORLD_SIZE", true}},
       "torchrun and the deepspeed launcher start processes, not an MPI world"},
      // SLURM_NPROCS is SLURM_NTASKS's older name; SLURM_STEP_NUM_TASKS the job step's.
      {"srun (Slurm)",
       {{"SLURM_NTASKS", true},
        {"SLURM_NPROCS", true},
        {"SLURM_STEP_NUM_TASKS", true},
        {"SLURM_PROCID", false},
        {"SLURM_LOCALID", false}},
       "srun alone makes an MPICH world only where MPICH is linked with Slurm's PMI (srun --mpi=pmi2); this "
       "MPICH's PMI client is hydra's: in an allocation, run mpirun there (hydra starts its ranks through srun; "
       "`mpirun -n 1` for one rank in a larger allocation)"},
      {"Open MPI's mpirun (PMIx)",
       {{"OMPI_COMM_WORLD_SIZE", true},
        {"OMPI_COMM_WORLD_RANK", false},
        {"OMPI_COMM_WORLD_LOCAL_RANK", false},
        {"PMIX_RANK", false}},
       "This program is built with MPICH, which Open MPI's launcher cannot connect: use MPICH's mpirun "
       "(mpirun.mpich on Debian)"},
      {"a PMI process manager that MPI did not connect to (no PMI_FD or PMI_PORT: copied variables?)",
       {{"PMI_SIZE", true}, {"PMI_RANK", false}},
       "Hydra passes its connection in PMI_FD or PMI_PORT, which this process lacks"}};
  return table;
}

// A variable's value as a count, or -1 when it is absent or not a plain
// non-negative number (another tool's business, not a world to compare).
long count_of(const char* name) {
  const char* text = std::getenv(name);
  if (!text || !*text) return -1;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  return *end || errno == ERANGE || value < 0 || value >= (1l << 30) ? -1 : value;
}
}  // namespace

void check_launch(const LaunchFacts& facts) {
  // A world MPI made is the world: an allocation's SLURM_NTASKS may exceed a
  // job step's `mpirun -n 2`, and a WORLD_SIZE exported in a shell is
  // another tool's. So is a world of one under hydra (`mpirun -n 1`, which
  // sets PMI_SIZE=1 and its connection).
  if (facts.world_size > 1) return;
  const bool connected = std::getenv("PMI_FD") || std::getenv("PMI_PORT");
  if (connected && count_of("PMI_SIZE") == facts.world_size) return;
  long named = 0;
  std::string listed, who, why;
  for (const Launcher& launcher : launchers()) {
    std::string mine;
    for (const Variable& variable : launcher.variables) {
      const long value = count_of(variable.name);
      if (value < 0) continue;
      mine += (mine.empty() ? "" : ", ") + std::string(variable.name) + "=" + std::to_string(value);
      named = std::max(named, variable.size ? value : value + 1);
    }
    if (mine.empty()) continue;
    listed += (listed.empty() ? "" : "; ") + mine + ": " + launcher.who;
    why += std::string(" ") + launcher.why + ".";
  }
  if (named <= facts.world_size) return;
  fail(
      "the environment names a world of %ld processes (%s), but MPI started this process alone (a world of %d "
      "rank): each process would train a one-rank copy of the run and write the same files.%s zero2's ranks are "
      "MPI's: start them with MPICH's mpirun, e.g. `mpirun -n %ld train_bert_mini ...` (notes/07, \"Launching\")",
      named, listed.c_str(), facts.world_size, why.c_str(), named);
}

void check_local_rank(const Settings& settings, const LaunchFacts& facts) {
  if (settings.local_rank < 0 || settings.local_rank == facts.local_rank) return;
  fail(
      "--local_rank %d, but MPI's local rank of rank %d (its index among the ranks on this host, which picks its "
      "GPU) is %d: the flag (which DeepSpeed's launcher appends) must name the same rank. Drop --local_rank (the "
      "device follows MPI's local rank), or start the run with mpirun alone",
      settings.local_rank, facts.rank, facts.local_rank);
}

}  // namespace bert
