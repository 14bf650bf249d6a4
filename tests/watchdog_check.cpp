// tests/watchdog_check.cpp — the watchdog's roll call when every rank is
// alive but they wait for different things (a desynchronized program: the
// case PyTorch's desync report is for). Rank 0 waits for a message rank 1
// never sends; every other rank waits in a barrier rank 0 never joins. Each
// rank's deadline passes; its roll call must find every rank answering and
// say what each waits for (tests/cli/reliability.sh checks the text). The
// stopped-rank case (a rank that does not answer) is the trainer's own test.
//   mpirun -n 3 build/watchdog_check SECONDS     (exits 3 by MPI_Abort, on purpose)
#include <cstdio>
#include <cstdlib>

#include "../zero2.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size < 2) {
    if (rank == 0) fprintf(stderr, "usage: mpirun -n N (N >= 2) %s SECONDS\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  z2::set_watchdog_timeout(atof(argv[1]));
  z2::set_watchdog_context("the desynchronized test program");
  MPI_Comm comm;  // not MPI_COMM_WORLD, as the engine: the roll call's tags are on the world
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Request request;
  int never_sent = 0;
  if (rank == 0) {
    MPI_Irecv(&never_sent, 1, MPI_INT, 1, 7, comm, &request);
    z2::wait_request(&request, "a message from rank 1");
  } else {
    MPI_Ibarrier(comm, &request);
    z2::wait_request(&request, "a barrier");
  }
  fprintf(stderr, "rank %d: the wait ended, which it must not\n", rank);
  MPI_Finalize();
  return 1;
}
