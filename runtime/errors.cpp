// runtime/errors.cpp — how zero2 stops: one check function per library (MPI,
// CUDA, cuBLAS, NCCL), each printing where the call was, what the library
// said and a hint, then taking every rank down with MPI_Abort (a rank that
// simply exited would leave the others blocked in their next collective);
// usage errors, thrown as z2::Error alike on every rank; messages of any
// length. Host code: the CUDA libraries' messages come from their host APIs.
#include "zero2.h"

#include <unistd.h>

#include <cstdlib>
#if defined(Z2_HAVE_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif
#if defined(Z2_HAVE_NCCL)
#include <nccl.h>
#endif

namespace z2 {

[[noreturn]] void abort_all_ranks(const char* library, const char* message, const char* call, const char* file,
                                  int line) {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const char* hint = "";
  if (!strcmp(library, "CUDA"))
    hint =
        "no GPU or out of memory? try --device cpu, a smaller --micro-batch, or CUDA_LAUNCH_BLOCKING=1 "
        "to find the failing kernel";
  else if (!strcmp(library, "cuBLAS")) hint = "check the matrix sizes and leading dimensions passed to gemm";
  else if (!strcmp(library, "NCCL"))
    hint = "NCCL needs one GPU per rank (several ranks on one GPU: --comm mpi); NCCL_DEBUG=INFO says more";
  else if (!strcmp(library, "MPI"))
    hint = "every rank must call the same collectives in the same order; check the mpirun command";
  else if (!strcmp(library, "sim"))
    hint =
        "the simulated device (--device sim) keeps the GPU's rules: order two streams by an event recorded on "
        "one and waited for on the other; reach device memory only by Compute::copy (notes/15-streams.md)";
  else if (!strcmp(library, "memory"))
    hint = "a smaller model or micro-batch, fewer ranks per host, or a higher stage to shard more";
  fprintf(stderr, "[zero2] rank %d: %s error at %s:%d\n  call:    %s\n  message: %s\n  hint:    %s\n", rank, library,
          file, line, call, message, hint);
  fflush(stderr);
  // mpirun forwards a rank's stderr through its proxy, and MPI_Abort has the
  // proxies kill every rank: a message still on its way can be lost (seen when
  // two ranks stop at once). A fifth of a second lets it arrive.
  if (initialized && !finalized) usleep(200000), MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, message, &length);
  abort_all_ranks("MPI", message, call, file, line);
}

void check_cuda(int code, const char* call, const char* file, int line) {
  if (code == 0) return;
#if defined(Z2_HAVE_CUDA)
  abort_all_ranks("CUDA", cudaGetErrorString((cudaError_t)code), call, file, line);
#else
  abort_all_ranks("CUDA", "CUDA call in a build without CUDA", call, file, line);
#endif
}

void check_cublas(int code, const char* call, const char* file, int line) {
  if (code == 0) return;
#if defined(Z2_HAVE_CUDA)
  abort_all_ranks("cuBLAS", cublasGetStatusString((cublasStatus_t)code), call, file, line);
#else
  abort_all_ranks("cuBLAS", "cuBLAS call in a build without CUDA", call, file, line);
#endif
}

void check_nccl(int code, const char* call, const char* file, int line) {
  if (code == 0) return;
#if defined(Z2_HAVE_NCCL)
  abort_all_ranks("NCCL", ncclGetErrorString((ncclResult_t)code), call, file, line);
#else
  abort_all_ranks("NCCL", "NCCL call in a build without NCCL", call, file, line);
#endif
}

#if defined(Z2_HAVE_CUDA)
// cudaGetLastError after a kernel launch (runtime/compute.h declares it for nvcc's files).
void launch_check(const char* file, int line) { check_cuda((int)cudaGetLastError(), "kernel launch", file, line); }
#endif

std::string format_message(const char* format, va_list arguments) {
  va_list measuring;
  va_copy(measuring, arguments);  // a va_list is used up by one pass: one to measure, one to write
  const int length = vsnprintf(nullptr, 0, format, measuring);
  va_end(measuring);
  if (length <= 0) return length == 0 ? "" : format;  // < 0: a bad format; its text says more than nothing
  std::string message((size_t)length + 1, '\0');
  vsnprintf(message.data(), message.size(), format, arguments);
  message.resize((size_t)length);
  return message;
}

std::string format_text(const char* format, ...) {
  va_list arguments;
  va_start(arguments, format);
  std::string text = format_message(format, arguments);
  va_end(arguments);
  return text;
}

[[noreturn]] void usage_error(const char* format, ...) {
  va_list arguments;
  va_start(arguments, format);
  std::string message = format_message(format, arguments);
  va_end(arguments);
  throw Error(message);
}
std::string with_commas(size_t value) {
  std::string digits = std::to_string(value), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace z2
