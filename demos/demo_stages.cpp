// demos/demo_stages.cpp — `make demo`, the engine alone on its smallest model: trains the
// test MLP with stage 0, 1 and 2 on the same data, prints the loss of every
// step, each stage's memory and communication ledger, and checks that the
// three stages end with the same parameters, bit for bit.
//
//   mpirun -n 2 build/demo_stages [--device auto|cpu|cuda] [--comm auto|mpi|nccl]
//                                 [--steps S] [--accum A] [--bucket ELEMS] [--overlap 0|1]
//                                 [--collectives deterministic|native]
//                                 [--hidden H] [--layers L] [--micro-batch B]
//                                 [--markdown ledger|hashes]
//
// --markdown prints only Markdown table rows (notes/generate.sh collects them
// for N = 1, 2, 4): `ledger` the memory and communication ledgers, `hashes` the
// last loss and the final parameter hash of each stage.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tests/mlp_model.h"  // the test MLP: MlpModel, its data and its loss

namespace {

struct Arguments {
  std::string device = "auto", comm = "auto", collectives = "deterministic";
  int steps = 8, accumulation = 1;
  long bucket = 2048;
  bool overlap = true;
  std::string markdown;  // "", "ledger" or "hashes"
  mlp::Config model;
};

// An integer in [low, high], or a usage error naming the flag.
long parse_number(const char* flag, const char* text, long low, long high) {
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  if (!*text || *end || errno == ERANGE || value < low || value > high)
    z2::usage_error("%s wants an integer from %ld to %ld (got '%s')", flag, low, high, text);
  return value;
}

Arguments parse(int argc, char** argv) {
  Arguments arguments;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) z2::usage_error("%s needs a value", flag.c_str());
    const char* value = argv[++i];
    if (flag == "--device") arguments.device = value;
    else if (flag == "--comm") arguments.comm = value;
    else if (flag == "--collectives") arguments.collectives = value;
    else if (flag == "--markdown") arguments.markdown = value;
    else if (flag == "--steps") arguments.steps = (int)parse_number("--steps", value, 1, 1000000);
    else if (flag == "--accum") arguments.accumulation = (int)parse_number("--accum", value, 1, 1 << 20);
    else if (flag == "--bucket") arguments.bucket = parse_number("--bucket", value, 1, INT_MAX);
    else if (flag == "--overlap") arguments.overlap = parse_number("--overlap", value, 0, 1) != 0;
    else if (flag == "--hidden") arguments.model.hidden = (int)parse_number("--hidden", value, 1, 1 << 16);
    else if (flag == "--layers") arguments.model.layers = (int)parse_number("--layers", value, 1, 1024);
    else if (flag == "--micro-batch")
      arguments.model.micro_batch = (int)parse_number("--micro-batch", value, 1, 1 << 16);
    else z2::usage_error("unknown flag '%s' (see the comment at the top of demos/demo_stages.cpp)", flag.c_str());
  }
  if (!arguments.markdown.empty() && arguments.markdown != "ledger" && arguments.markdown != "hashes")
    z2::usage_error("--markdown must be ledger or hashes (got '%s')", arguments.markdown.c_str());
  if (arguments.collectives != "deterministic" && arguments.collectives != "native")
    z2::usage_error("--collectives must be deterministic or native (got '%s')", arguments.collectives.c_str());
  return arguments;
}

int demo(int argc, char** argv) {
  Arguments arguments = parse(argc, argv);
  int rank = 0, N = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &N);
  const z2::Device device = z2::choose_device(arguments.device, MPI_COMM_WORLD);
  const z2::CommBackend backend = z2::choose_comm(arguments.comm, device, MPI_COMM_WORLD);
  const z2::Collectives collectives =
      arguments.collectives == "native" ? z2::Collectives::native : z2::Collectives::deterministic;
  z2::Compute compute(device, z2::local_rank_of(MPI_COMM_WORLD));
  z2::Communicator comm(compute, MPI_COMM_WORLD, backend, collectives);
  const bool talk = rank == 0 && arguments.markdown.empty();

  const mlp::Config& model_config = arguments.model;
  if (talk)
    printf(
        "zero2 demo: the test MLP (%d -> %d x %d -> %d), %d rank(s), device %s, comm %s, %s collectives,\n"
        "micro-batch %d x accumulation %d x %d ranks, bucket %ld elements, overlap %s, %d steps, AdamW + clipping\n\n",
        model_config.input, model_config.hidden, model_config.layers - 1, model_config.classes, N,
        z2::to_string(device), z2::to_string(backend), z2::to_string(collectives), model_config.micro_batch,
        arguments.accumulation, N, arguments.bucket, arguments.overlap ? "on" : "off", arguments.steps);

  uint64_t hashes[3] = {};
  double median_ms[3] = {};
  for (int stage = 0; stage <= 2; ++stage) {
    z2::EngineOptions options;
    options.stage = stage;
    options.bucket_elements = arguments.bucket;
    options.accumulation_steps = arguments.accumulation;
    options.overlap = arguments.overlap;
    options.lr = 1e-2;
    options.clip = 1.0;
    z2::Engine engine(compute, comm, options);
    mlp::Model model(compute, engine, model_config);
    engine.build();
    model.initialize();
    if (talk) printf("stage %d  step  loss        grad norm   ms\n", stage);
    float last_loss = 0;
    std::vector<double> times;
    for (int s = 0; s < arguments.steps; ++s) {
      double start = MPI_Wtime();
      z2::StepReport report = model.train_step(s);
      compute.synchronize_all();  // a step is done when the device is
      double milliseconds = (MPI_Wtime() - start) * 1e3;
      times.push_back(milliseconds);
      last_loss = report.loss;
      if (talk && (s < 3 || s + 1 == arguments.steps || s % 10 == 0))
        printf("         %4d  %.6f  %.6f  %.2f\n", s + 1, report.loss, report.grad_norm, milliseconds);
    }
    std::sort(times.begin(), times.end());
    median_ms[stage] = times[times.size() / 2];
    hashes[stage] = engine.parameters_hash();
    if (talk) {
      printf("final parameters hash %016llx, median step %.2f ms\n", (unsigned long long)hashes[stage],
             median_ms[stage]);
      engine.print_ledgers(stdout);
      printf("\n");
    }
    if (rank == 0 && arguments.markdown == "ledger") {
      z2::MemoryLedger m = engine.memory_ledger();
      z2::CommLedger c = engine.comm_ledger();
      size_t sent = c.per_step.reduce_scatter + c.per_step.all_gather + c.per_step.all_reduce;
      printf("| %d | %d | %zu | %zu | %zu | %zu | %zu | %zu | %zu | %zu | %zu |\n", N, stage, engine.psi_padded(),
             m.params, m.grads, m.optimizer, m.model_states, m.model_states_formula, m.staging, sent,
             c.formula_per_step);
    }
    if (rank == 0 && arguments.markdown == "hashes") {
      uint32_t bits;
      std::memcpy(&bits, &last_loss, sizeof bits);
      printf("| %d | %d | %d | %s | %.7f | %08x | %016llx |\n", N, arguments.accumulation, stage,
             z2::to_string(collectives), last_loss, bits, (unsigned long long)hashes[stage]);
    }
  }
  const bool same = hashes[0] == hashes[1] && hashes[1] == hashes[2];
  if (talk) {
    printf("median step: stage 0 %.2f ms, stage 1 %.2f ms, stage 2 %.2f ms\n", median_ms[0], median_ms[1],
           median_ms[2]);
    if (same) printf("stages 0, 1, 2: identical final parameters, bit for bit\n");
    else if (collectives == z2::Collectives::native)
      printf(
          "stages 0, 1, 2: final parameters differ in the low bits, as expected with native collectives\n"
          "(the library chooses the summation order; use --collectives deterministic for equal bits)\n");
    else printf("stages 0, 1, 2: DIFFERENT final parameters (a bug: please report it)\n");
  }
  return same || collectives == z2::Collectives::native ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 1;
  try {
    status = demo(argc, argv);
  } catch (const z2::Error& error) {
    // Usage errors are raised identically on every rank; rank 0 says it once.
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) fprintf(stderr, "demo_stages: %s\n", error.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
