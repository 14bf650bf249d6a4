// runtime/errors.h — how zero2 stops (part of zero2.h: include zero2.h, not
// this): usage errors thrown alike on every rank, library failures checked
// with file:line, the library's message and a hint, and the watchdog that
// ends a job whose ranks wait for one that never comes (runtime/errors.cpp,
// runtime/watchdog.cpp).
#pragma once

namespace z2 {

// Two kinds. A usage error (bad bucket size, a parameter registered too late)
// throws z2::Error: every rank sees the same arguments, so every rank throws
// at the same place and the caller decides how to exit. A library failure
// (CUDA, cuBLAS, NCCL, MPI) may happen on one rank only; its check prints
// file:line, the library's message and a hint, then MPI_Abort()s every rank,
// because the other ranks may already be waiting in a collective.

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Codes are passed as int so this header needs no CUDA types; zero2.cu turns
// them back into cudaError_t / cublasStatus_t / ncclResult_t for the message.
void check_mpi(int code, const char* call, const char* file, int line);
void check_cuda(int code, const char* call, const char* file, int line);
void check_cublas(int code, const char* call, const char* file, int line);
void check_nccl(int code, const char* call, const char* file, int line);
[[noreturn]] void abort_all_ranks(const char* library, const char* message, const char* call, const char* file,
                                  int line);

#define Z2_MPI_CHECK(call) ::z2::check_mpi((call), #call, __FILE__, __LINE__)
#define Z2_CUDA_CHECK(call) ::z2::check_cuda(static_cast<int>(call), #call, __FILE__, __LINE__)
#define Z2_CUBLAS_CHECK(call) ::z2::check_cublas(static_cast<int>(call), #call, __FILE__, __LINE__)
#define Z2_NCCL_CHECK(call) ::z2::check_nccl(static_cast<int>(call), #call, __FILE__, __LINE__)

// Throw z2::Error with a printf-style message.
[[noreturn]] void usage_error(const char* format, ...);
// A printf-style message whole, however long (a path may take kilobytes: a
// fixed buffer would cut off the reason that follows it).
std::string format_message(const char* format, va_list arguments);
std::string format_text(const char* format, ...);  // the same, from the arguments themselves

// The watchdog (--timeout; README, "When something goes wrong"). Every wait
// of the engine and the trainer — an MPI request, a CUDA stream — polls
// against a deadline of watchdog_timeout() seconds from the moment it began.
// Past it the rank holds a roll call (each waiting rank answers what it
// waits for; a stopped, stuck or dead one does not), prints what it waited
// for (which collective, which bucket, in which step), which ranks did not
// answer and where the others are, and takes the job down: NCCL
// communicators first (ncclCommAbort, as PyTorch's watchdog does), then
// MPI_Abort. A stopped, stuck or dead rank ends the job within the timeout
// (plus the roll call's grace, a tenth of it, 1 to 10 s) instead of leaving
// the others waiting forever.
void set_watchdog_timeout(double seconds);  // default 600; > 0
double watchdog_timeout();
void set_watchdog_context(const std::string& where);  // e.g. "optimizer step 7": named in the message
[[noreturn]] void watchdog_expired(const std::string& waited_for);
// Poll `done` until it returns true, or the watchdog expires; `describe`
// names what is waited for (asked only at expiry or by a roll call).
void wait_until(const std::function<bool()>& done, const std::function<std::string()>& describe);
// MPI_Test polled until `request` completes, or the watchdog expires;
// `what` names it in the message ("the all-gather of the loss").
void wait_request(MPI_Request* request, const std::string& what);
// MPI_Allreduce and MPI_Bcast with the watchdog (non-blocking, waited on).
void watched_allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                       const std::string& what);
void watched_bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm, const std::string& what);
// The NCCL communicators (ncclComm_t) the watchdog aborts before it ends the
// job: a kernel waiting for a peer that never comes would never finish.
// runtime/communicator.cpp registers each one it makes, and forgets it when it goes.
void watch_nccl_communicator(void* comm);
void unwatch_nccl_communicator(void* comm);

// 1234567 -> "1,234,567", for the ledgers and the trainer's messages.
std::string with_commas(size_t value);

}  // namespace z2
