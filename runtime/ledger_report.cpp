// runtime/ledger_report.cpp — the ledgers as a table (printed by rank 0
// after a run) and as JSON (the trainer's --json), each measured figure
// beside its formula. The figures and the formulas are zero2.cu's
// (Engine::memory_ledger, Engine::comm_ledger); this file only lays them
// out. Host code.
#include "runtime/engine_state.h"

#include <sstream>

namespace z2 {

// The formulas of zero2.cu ("The ledger") as the tables print them.
const char* model_states_formula_text(int stage, Precision precision, bool offload) {
  static const char* fp32[] = {"16 Psi", "8 Psi + 8 Psi/N", "4 Psi + 12 Psi/N"};
  static const char* mixed[] = {"16 Psi", "4 Psi + 12 Psi/N", "2 Psi + 14 Psi/N"};
  static const char* offloaded_fp32[] = {"16 Psi", "8 Psi", "4 Psi"};
  static const char* offloaded_mixed[] = {"16 Psi", "4 Psi", "2 Psi"};
  if (offload) return precision == Precision::fp32 ? offloaded_fp32[stage] : offloaded_mixed[stage];
  return precision == Precision::fp32 ? fp32[stage] : mixed[stage];
}

const char* offloaded_states_formula_text(bool offload) { return offload ? "16 Psi/N" : "0"; }

static void print_host_column(FILE* out, const MemoryLedger& ledger);  // ZeRO-Offload's part, below

void Engine::print_ledgers(FILE* out) const {
  MemoryLedger ledger = memory_ledger();
  CommLedger c = comm_ledger();
  const int N = comm_.world_size();
  const Precision precision = options_.precision;
  const bool mixed = precision != Precision::fp32;
  const char* type = to_string(precision);
  const int e = (int)element_bytes(precision), accumulation_e = (int)model_states().accumulation_element;
  fprintf(out, "memory per rank: stage %d, N = %d, %s, Psi = %s, Psi_padded = %s, %zu bucket(s), device %s\n",
          options_.stage, N, type, with_commas(psi()).c_str(), with_commas(psi_padded()).c_str(), buckets_.size(),
          to_string(compute_.device()));
  fprintf(out, "  %-22s %14s   (%s, %d bytes an element)\n", "params", with_commas(ledger.params).c_str(), type, e);
  fprintf(out, "  %-22s %14s   (%s)\n", "grads", with_commas(ledger.grads).c_str(), type);
  fprintf(out, "  %-22s %14s   (fp32)\n", "optimizer (m, v)", with_commas(ledger.optimizer).c_str());
  fprintf(out, "  %-22s %14s   %s\n", "master", with_commas(ledger.master).c_str(),
          mixed ? "(fp32 weights AdamW updates; the params are them rounded)"
                : "(fp32: the parameters are the master copy)");
  fprintf(out, "  %-22s %14s   formula %s = %s %s\n", "model states", with_commas(ledger.model_states).c_str(),
          model_states_formula_text(options_.stage, precision, ledger.offload_optimizer),
          with_commas(ledger.model_states_formula).c_str(),
          ledger.model_states == ledger.model_states_formula ? "(equal)" : "(DIFFERS)");
  if (ledger.offload_optimizer) print_host_column(out, ledger);
  fprintf(out, "  %-22s %14s   floor(log2 A) x %d Psi/N = %s%s\n", "accumulation tree",
          with_commas(ledger.accumulation).c_str(), accumulation_e, with_commas(ledger.accumulation_formula).c_str(),
          mixed && accumulation_e == 4 ? " (fp32 blocks: not in the paper's K = 12)" : "");
  fprintf(out, "  %-22s %14s   slots x (bucket + (N-1) shards) = %s\n", "staging", with_commas(ledger.staging).c_str(),
          with_commas(ledger.staging_formula).c_str());
  fprintf(out, "  %-22s %14s\n", "activation peak", with_commas(ledger.activations).c_str());
  fprintf(out, "  %-22s %14s\n", "bookkeeping", with_commas(ledger.bookkeeping).c_str());
  fprintf(out, "  %-22s %14s   (host, for --comm mpi on cuda)\n", "pinned staging",
          with_commas(ledger.host_pinned).c_str());
  fprintf(out, "  %-22s %14s   (host, activation checkpoints)\n", "host offload peak",
          with_commas(ledger.host_offload_peak).c_str());
  fprintf(out, "  %-22s %14s   (peak live bytes)\n", "device peak", with_commas(ledger.device_peak).c_str());
  if (compute_.allocator() == Allocator::direct)
    fprintf(out, "  %-22s %14s   (Allocator::direct: one allocation per buffer)\n", "reserved",
            with_commas(ledger.reserved).c_str());
  else if (compute_.allocator() == Allocator::caching)
    fprintf(out, "  %-22s %14s   (peak of the segments under the %s-byte device limit, --alloc caching)\n", "reserved",
            with_commas(ledger.reserved).c_str(), with_commas(ledger.capacity).c_str());
  else
    fprintf(out, "  %-22s %14s   (peak used part of the %s-byte block, --alloc %s)\n", "reserved",
            with_commas(ledger.reserved).c_str(), with_commas(ledger.capacity).c_str(),
            to_string(compute_.allocator()));
  fprintf(out, "  %-22s %14.4f   (1 - peak live / peak reserved)\n", "fragmentation", ledger.fragmentation);
  fprintf(out, "  %-22s %14ld   (allocator calls in the last step; %ld arena stack pushes)\n", "allocations/step",
          ledger.device_allocations_per_step, ledger.stack_pushes_per_step);
  fprintf(out, "  %-22s %14ld   (allocator calls after step 1; %ld device mallocs in all)\n", "after step 1",
          ledger.device_allocations_after_step1, ledger.device_mallocs);
  fprintf(out, "communication per rank per step (bytes, as a ring sends them)\n");
  fprintf(out, "  %-22s %14s\n", "reduce-scatter", with_commas(c.per_step.reduce_scatter).c_str());
  fprintf(out, "  %-22s %14s\n", "all-gather", with_commas(c.per_step.all_gather).c_str());
  fprintf(out, "  %-22s %14s\n", "all-reduce", with_commas(c.per_step.all_reduce).c_str());
  size_t total = c.per_step.reduce_scatter + c.per_step.all_gather + c.per_step.all_reduce;
  fprintf(out, "  %-22s %14s   formula %s = %s %s\n", "total", with_commas(total).c_str(),
          e == 4 ? "(A + 1) (N-1)/N Psi x 4" : "(A + 1) (N-1)/N Psi x 2", with_commas(c.formula_per_step).c_str(),
          total == c.formula_per_step ? "(equal)" : "(DIFFERS)");
  fprintf(out, "  %-22s %14s   (loss and norm chunk sums%s, over MPI)\n", "other",
          with_commas(c.per_step.other).c_str(), precision == Precision::fp16 ? ", the overflow flag" : "");
}

// ZeRO-Offload: what the host holds, in pinned memory, beside 16 Psi/N.
static void print_host_column(FILE* out, const MemoryLedger& ledger) {
  const bool mixed = ledger.precision != Precision::fp32;
  fprintf(out, "  host (ZeRO-Offload, pinned):\n");
  fprintf(out, "  %-22s %14s   (%s)\n", "  master", with_commas(ledger.host_master).c_str(),
          mixed ? "fp32 weights AdamW updates" : "fp32: the master; the device's parameters are its copy");
  fprintf(out, "  %-22s %14s   (fp32)\n", "  optimizer (m, v)", with_commas(ledger.host_optimizer).c_str());
  fprintf(out, "  %-22s %14s   (the reduced shard, copied down)\n", "  grads", with_commas(ledger.host_grads).c_str());
  fprintf(out, "  %-22s %14s   (%s)\n", "  params", with_commas(ledger.host_params).c_str(),
          mixed ? "the updated shard rounded, on its way up" : "fp32: the master goes up itself");
  fprintf(out, "  %-22s %14s   formula %s = %s %s\n", "  host model states",
          with_commas(ledger.host_model_states).c_str(), offloaded_states_formula_text(true),
          with_commas(ledger.host_model_states_formula).c_str(),
          ledger.host_model_states == ledger.host_model_states_formula ? "(equal)" : "(DIFFERS)");
  fprintf(out, "  %-22s %14s   (norm chunk sums, decay flags)\n", "  host bookkeeping",
          with_commas(ledger.host_bookkeeping).c_str());
}

std::string Engine::ledgers_json() const {
  MemoryLedger m = memory_ledger();
  CommLedger c = comm_ledger();
  std::ostringstream json;
  json.precision(17);  // the fragmentation, exactly as 1 - peak / reserved computed it
  json << "{\"memory\": {\"model_states_bytes\": " << m.model_states
       << ", \"model_states_formula_bytes\": " << m.model_states_formula << ", \"params_bytes\": " << m.params
       << ", \"grads_bytes\": " << m.grads << ", \"optimizer_bytes\": " << m.optimizer
       << ", \"master_bytes\": " << m.master << ", \"accumulation_bytes\": " << m.accumulation
       << ", \"accumulation_formula_bytes\": " << m.accumulation_formula << ", \"precision\": \""
       << to_string(m.precision) << "\", \"model_states_formula\": \""
       << model_states_formula_text(options_.stage, m.precision, m.offload_optimizer) << "\""
       << ", \"offload_optimizer\": " << (m.offload_optimizer ? "true" : "false")
       << ", \"host_model_states_bytes\": " << m.host_model_states
       << ", \"host_model_states_formula_bytes\": " << m.host_model_states_formula
       << ", \"host_master_bytes\": " << m.host_master << ", \"host_optimizer_bytes\": " << m.host_optimizer
       << ", \"host_grads_bytes\": " << m.host_grads << ", \"host_params_bytes\": " << m.host_params
       << ", \"host_bookkeeping_bytes\": " << m.host_bookkeeping << ", \"staging_bytes\": " << m.staging
       << ", \"bookkeeping_bytes\": " << m.bookkeeping << ", \"activation_peak_bytes\": " << m.activations
       << ", \"host_offload_peak_bytes\": " << m.host_offload_peak << ", \"host_pinned_bytes\": " << m.host_pinned
       << ", \"device_peak_bytes\": " << m.device_peak << ", \"reserved_bytes\": " << m.reserved
       << ", \"capacity_bytes\": " << m.capacity << ", \"fragmentation\": " << m.fragmentation
       << ", \"device_allocations_after_step1\": " << m.device_allocations_after_step1
       << ", \"device_allocations_per_step\": " << m.device_allocations_per_step
       << ", \"stack_pushes_per_step\": " << m.stack_pushes_per_step << ", \"device_mallocs\": " << m.device_mallocs
       << ", \"allocator\": \"" << to_string(compute_.allocator())
       << "\"}, \"comm\": {\"reduce_scatter_bytes_per_step\": " << c.per_step.reduce_scatter
       << ", \"all_gather_bytes_per_step\": " << c.per_step.all_gather
       << ", \"all_reduce_bytes_per_step\": " << c.per_step.all_reduce
       << ", \"other_bytes_per_step\": " << c.per_step.other << ", \"formula_bytes_per_step\": " << c.formula_per_step
       << "}}";
  return json.str();
}

}  // namespace z2
