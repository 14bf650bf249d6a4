// trainer/reports.h — what a run tells: the header before step 1, the
// progress lines and --metrics while it trains, the summary and the --json
// summary at the end, and the first step's memory trace. Rank 0 prints and
// writes; the other ranks stay quiet. Apart from the model because a report
// reads plain facts of the run (RunRecord), the settings and the engine, the
// same in every precision: it is compiled once. Defined in trainer/reports.cpp.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/checkpoints.h"
#include "trainer/model_shape.h"
#include "trainer/output_files.h"
#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

struct StepRecord {
  long step;
  float loss, grad_norm;  // grad_norm NaN (null in the JSON) on a skipped step
  double lr, ms, tokens_per_s;
  double loss_scale;  // the scale this step's gradients carried (fp16; 1 otherwise)
  bool skipped;       // fp16 overflow: no update
  double beta1 = 0, beta2 = 0;  // Adam's betas of the update (a scheduler may set them per step)
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;  // wall_clock_breakdown only
  double gemm_ms = 0;  // of ms, the time inside sgemm (cpu; 0 on cuda, where gemm only queues work)
};
struct Evaluation {
  long step;
  float loss;  // the held-out MLM loss (--eval-every)
};

// The run as its reports tell it: what it is (set before step 1) and what it
// did (a record per step, evaluation and save).
struct RunRecord {
  int world_size = 1;
  z2::Device device = z2::Device::cpu;
  z2::CommBackend comm = z2::CommBackend::mpi;
  z2::Precision precision = z2::Precision::fp32;
  ModelShape shape{};
  ActivationMode mode = ActivationMode::keep;
  z2::Allocator allocator = z2::Allocator::arena;
  size_t memory_block = 0;  // what each rank's allocator may use (Compute::capacity)
  long tokens_per_step = 0;
  size_t corpus_bytes = 0, held_out_bytes = 0;  // the data, and the tail --eval-every holds out of it
  z2::MemoryLedger start_ledger;                // the engine's, before step 1
  std::optional<LoadedCheckpoint> loaded;       // --load
  std::vector<std::string> initial_weights_unused;  // --init-hf's tensors BertForMaskedLM does not use
  std::vector<StepRecord> steps;                // this run's steps, in order
  std::vector<Evaluation> evaluations;
  std::vector<SavedCheckpoint> saved;
  int interrupted_by = 0;  // the signal that stopped the run early, or 0
};

// Rank 0, before step 1 (unless --quiet).
void print_header(const Settings& settings, const RunRecord& run, const z2::Engine& engine);
// Rank 0, at the end (unless --quiet): the losses, the hash, the saves, the ledgers.
void print_summary(const Settings& settings, const RunRecord& run, const z2::Engine& engine, const std::string& hash);
// --json FILE: the run's summary (the caller picks the rank that writes it).
void write_json(const Settings& settings, const RunRecord& run, const z2::Engine& engine, const std::string& hash);
// --memory-trace FILE: the first step's allocator events, as CSV.
void write_memory_trace(const std::string& path, const std::vector<z2::MemorySample>& trace);

// The progress lines (rank 0 prints them, unless --quiet) and --metrics (rank
// 0 appends a line for each). Every rank logs the same steps, so all can
// agree on rank 0's write (a full disk ends every rank, not only the writer).
class ProgressLog {
 public:
  ProgressLog(const Settings& settings, MPI_Comm world);
  ~ProgressLog();
  bool prints() const { return prints_; }
  // Before step 1: --metrics made (a resumed run continues it after
  // `resumed_step`), and the clock of this run's training started.
  void start(long resumed_step);
  // After each step: an overflow's line, or the progress line of every
  // --log-every steps (and of the first and the last).
  void step(const RunRecord& run, const z2::Engine& engine, const z2::StepReport& report, double ms,
            const z2::MemoryCounters& memory);
  void evaluation(long step, float loss);

 private:
  const Settings& settings_;
  MPI_Comm world_;
  int rank_ = 0;
  bool prints_ = false;
  // When this run's training began, the losses since the last progress line
  // (their mean goes in the metrics), and the stream itself.
  std::chrono::steady_clock::time_point training_start_;
  double loss_since_log_ = 0;
  long losses_since_log_ = 0;
  std::unique_ptr<MetricsStream> metrics_;
};

}  // namespace bert
