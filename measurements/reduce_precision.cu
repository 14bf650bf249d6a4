// measurements/reduce_precision.cu — what a 16-bit gradient reduction costs in
// accuracy, measured on a real BERT-mini gradient (notes/08).
//
// Each of the N ranks computes the 16-bit gradient of its own micro-batch
// (the default BERT-mini at initialization, step 0, the micro-batch m = rank;
// in fp16 scaled by the loss scale 2^16 as training scales it). The sum of
// the N gradients is then formed two ways and compared with the exact sum
// (float64):
//   zero2      the engine's reduce-scatter (zero2.cu, "The reduce-scatter", run for real
//              over MPI): 16-bit slices on the wire, the N slices summed in
//              fp32 in the canonical tree, rounded to 16 bits once;
//   DeepSpeed  its ZeRO-2 default (stage_1_and_2.py, average_tensor): each
//              rank divides its 16-bit gradient by N in 16 bits, then a
//              16-bit ring all-reduce adds the slices hop by hop, rounding
//              every partial sum (as NCCL's 16-bit sum does); emulated here
//              on rank 0 in the ring's order (the chunk rank c keeps starts
//              at rank c + 1), and multiplied back by N (exact) to compare.
// Both move the same bytes. Printed per precision: the relative error of the
// whole gradient, the share of elements that are the exact sum correctly
// rounded, and the worst element's error in units of its last place.
//
//   mpirun -n 2 build/reduce_precision      (and -n 4; notes/generate.sh runs both)
#define BERT_NO_MAIN
#include "train_bert_mini.cu"

#include <cmath>

namespace {

// This rank's micro-batch gradient, 16-bit, as the training step would hand
// it to the reduction (fp16: scaled). One rank, one micro-step: the engine's
// "reduction" of a single leaf is the leaf itself.
template <class T>
std::vector<uint16_t> micro_batch_gradient(int rank, int ranks, float* scale) {
  bert::Settings settings;  // the default BERT-mini
  z2::Compute compute(z2::Device::cpu);
  z2::Communicator self(compute, MPI_COMM_SELF, z2::CommBackend::mpi, z2::Collectives::deterministic);
  z2::EngineOptions options;
  options.stage = 0, options.precision = z2::precision_of<T>();
  z2::Engine engine(compute, self, options);
  bert::ModelShape shape{settings.layers, settings.hidden,        settings.heads,       settings.intermediate,
                         settings.seq,    settings.max_positions, settings.micro_batch, settings.dropout,
                         settings.seed,   options.precision};
  bert::Model<T> model(compute, engine, shape);
  engine.build();
  model.initialize();
  const std::string& corpus = bert::default_corpus();
  const long step = 0,
             selected = bert::global_selected_count(corpus, settings.seed, step, ranks, shape.micro_batch, shape.seq);
  bert::Batch batch = bert::make_batch(corpus, settings.seed, step, rank, shape.micro_batch, shape.seq);
  model.run(batch, step, rank, 1.0f / (float)selected, true);
  *scale = engine.loss_scale();
  std::vector<float> gradient = engine.gradients_to_host();  // unscaled
  std::vector<uint16_t> bits(gradient.size());
  for (size_t i = 0; i < bits.size(); ++i)
    bits[i] = z2::from_float<T>(gradient[i] * *scale).bits;  // exact: a power of two
  return bits;
}

template <class T>
float widen(uint16_t bits) {
  return z2::to_float(T{bits});
}
template <class T>
uint16_t narrow(float value) {
  return z2::from_float<T>(value).bits;
}

struct Errors {
  double relative = 0;           // ||approx - exact|| / ||exact||
  double correctly_rounded = 0;  // share of elements within half an ulp of the exact sum
  double worst_ulps = 0;         // max |approx - exact| / ulp16(exact)
};

// ulp of the 16-bit format at `value` (its spacing there).
template <class T>
double ulp16(double value) {
  const int mantissa = std::is_same<T, z2::bfloat16>::value ? 7 : 10,
            min_exponent = std::is_same<T, z2::bfloat16>::value ? -126 : -14;
  int exponent = 0;
  std::frexp(value, &exponent);
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - mantissa);
}

template <class T>
Errors compare(const std::vector<uint16_t>& approx, const std::vector<double>& exact) {
  Errors errors;
  double difference = 0, norm = 0;
  size_t correct = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double got = widen<T>(approx[i]), d = got - exact[i];
    difference += d * d, norm += exact[i] * exact[i];
    const double ulps = std::fabs(d) / ulp16<T>(exact[i]);
    correct += ulps <= 0.5;
    errors.worst_ulps = std::max(errors.worst_ulps, ulps);
  }
  errors.relative = std::sqrt(difference / norm);
  errors.correctly_rounded = (double)correct / exact.size();
  return errors;
}

template <class T>
void measure(const char* name, int rank, int ranks) {
  float scale = 1;
  const std::vector<uint16_t> mine = micro_batch_gradient<T>(rank, ranks, &scale);
  const size_t psi = mine.size(), padded = (psi + ranks - 1) / ranks * ranks, shard = padded / ranks;
  std::vector<uint16_t> bucket(mine);
  bucket.resize(padded, 0);

  // zero2: the engine's own reduce-scatter, over MPI.
  z2::Compute compute(z2::Device::cpu);
  z2::Communicator world(compute, MPI_COMM_WORLD, z2::CommBackend::mpi, z2::Collectives::deterministic);
  std::vector<uint16_t> reduced_shard(shard), reduced(padded);
  {
    z2::BucketExchange exchange(compute, world, padded, 1, false, z2::precision_of<T>());
    z2::AccumulateInto into;
    into.result = reduced_shard.data();
    exchange.start_reduce_scatter(exchange.acquire(0), bucket.data(), padded, into);
    exchange.finish_all();
  }
  Z2_MPI_CHECK(MPI_Gather(reduced_shard.data(), (int)shard, MPI_UINT16_T, reduced.data(), (int)shard, MPI_UINT16_T, 0,
                          MPI_COMM_WORLD));
  std::vector<uint16_t> leaves(rank == 0 ? (size_t)ranks * padded : 0);
  Z2_MPI_CHECK(MPI_Gather(bucket.data(), (int)padded, MPI_UINT16_T, leaves.data(), (int)padded, MPI_UINT16_T, 0,
                          MPI_COMM_WORLD));
  if (rank != 0) return;

  std::vector<double> exact(psi);
  for (size_t i = 0; i < psi; ++i)
    for (int r = 0; r < ranks; ++r) exact[i] += widen<T>(leaves[(size_t)r * padded + i]);
  // DeepSpeed: divide by N in 16 bits, then the ring's 16-bit partial sums.
  std::vector<uint16_t> deepspeed(psi);
  for (size_t i = 0; i < psi; ++i) {
    const int chunk = (int)(i / shard);
    float sum = 0;
    for (int hop = 0; hop < ranks; ++hop) {
      const int r = (chunk + 1 + hop) % ranks;
      const float divided = widen<T>(narrow<T>(widen<T>(leaves[(size_t)r * padded + i]) / (float)ranks));
      sum = hop == 0 ? divided : widen<T>(narrow<T>(sum + divided));
    }
    deepspeed[i] = narrow<T>(sum * (float)ranks);  // back to a sum: exact (N a power of two)
  }
  reduced.resize(psi);
  const Errors ours = compare<T>(reduced, exact), theirs = compare<T>(deepspeed, exact);
  printf("| %s | %d | %.2e | %.2e | %.4f | %.4f | %.1f | %.1f |\n", name, ranks, ours.relative, theirs.relative,
         ours.correctly_rounded, theirs.correctly_rounded, ours.worst_ulps, theirs.worst_ulps);
  fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  try {
    if (ranks & (ranks - 1)) z2::usage_error("run it on a power-of-two number of ranks (got %d)", ranks);
    if (rank == 0 && argc > 1 && std::string(argv[1]) == "--header") {
      printf(
          "| precision | N | zero2: relative error | DeepSpeed: relative error | zero2: correctly rounded | "
          "DeepSpeed: correctly rounded | zero2: worst ulps | DeepSpeed: worst ulps |\n");
      printf("|---|---|---|---|---|---|---|---|\n");
    }
    measure<z2::bfloat16>("bf16", rank, ranks);
    measure<z2::float16>("fp16", rank, ranks);
  } catch (const std::exception& error) {
    if (rank == 0) fprintf(stderr, "reduce_precision: %s\n", error.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
