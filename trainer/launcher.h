// trainer/launcher.h — who started this process, checked before the command
// line is read: zero2's ranks are MPI's, and a launcher that does not start
// MPI (torchrun, DeepSpeed's launcher, srun without a PMI this MPICH speaks,
// Open MPI's mpirun) gives each process a world of its own, so N processes
// would each train a one-rank copy and write the same files. Also
// --local_rank (DeepSpeed's launcher appends it) against MPI's local rank.
// Defined in trainer/launcher.cpp; notes/07, "Launching", has the table.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <mpi.h>

#include <string>

#include "trainer/settings.h"

namespace bert {

// What MPI made of this process, gathered once before anything can fail:
// local_rank_of is a collective, and a rank that failed to read its config
// must not be the one rank missing from it.
struct LaunchFacts {
  int world_size = 1, rank = 0, local_rank = 0;
};
LaunchFacts launch_facts(MPI_Comm world);  // collective: every rank calls it

// Refuses a start whose environment names a world larger than MPI's (the
// variables of torchrun, DeepSpeed's launcher, srun, Open MPI and PMI),
// naming them and the command that works. Under a process manager MPI
// connected to (hydra's PMI_SIZE equal to MPI's size) or in any world MPI
// made larger than one, the variables are another tool's and are ignored.
void check_launch(const LaunchFacts& facts);

// --local_rank N (DeepSpeed's launcher appends --local_rank=N) must be MPI's
// local rank: this rank's index among the ranks on its host.
void check_local_rank(const Settings& settings, const LaunchFacts& facts);

}  // namespace bert
