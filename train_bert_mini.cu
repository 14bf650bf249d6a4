// train_bert_mini.cu — BERT-mini masked-language-model training through the
// zero2 engine, on the CPU (loops + OpenBLAS) or CUDA (kernels + cuBLAS), with
// ZeRO stage 0, 1 or 2 over MPI or NCCL. This file is the model and its
// training: the data, the math both backends share, forward and backward,
// what forward keeps for backward, and the training loop. The plumbing around
// it (flags and config files, output files, the export, checkpoints, the
// memory plan, the reports) is host-only C++ in trainer/, compiled once
// instead of once per precision.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
//
// The model is Hugging Face's BertForMaskedLM (notes/07): byte-level
// tokens, learned positions, one token type, post-LayerNorm blocks with GELU
// (erf form), an MLM head whose decoder is tied to the word embeddings. Every
// per-element or per-row operation is one Z2_HD function that a CPU loop and a
// CUDA kernel both call (through Compute::for_each); the matrix products go to
// Compute::gemm. There are no float atomics: every sum over rows (bias,
// LayerNorm and embedding gradients) has one thread per output walking the
// rows in order, so the same inputs give the same bits on every run.
//
// ZeRO-R (paper section 6): --activations keep|recompute|offload chooses what
// forward leaves for backward (the model's "activation memory" below), --alloc
// arena|naive|caching|cuda where device memory comes from (the engine's
// allocators, runtime/allocators.cpp), --device-memory-limit how much there
// is. Every combination gives the same bits.
//
// Mixed precision (notes/08): --precision bf16|fp16 (or the config's "bf16"
// / "fp16" blocks) trains the same model with 16-bit activations, working
// parameters and gradients: the model is one template over its storage type,
// Model<float> / Model<z2::bfloat16> / Model<z2::float16>, each operation
// computed in fp32 and rounded once; fp16 scales the loss (the engine's
// DeepSpeed-style scaler) and skips the steps whose gradients overflow.
//
// Checkpoints (notes/09, trainer/checkpoints.cpp): --save DIR writes one
// safetensors file per rank (its contiguous range of the canonical master,
// exp_avg, exp_avg_sq) and an index with its own SHA-256 beside it; --load
// DIR resumes at any N and stage with the same N x A and summation tree, to
// the bits of the run that never stopped. SIGINT / SIGTERM finish the step,
// save and exit 128 + the signal.
//
// DeepSpeed configs (notes/07, trainer/deepspeed_config.cpp): --config reads
// them as DeepSpeed does, and refuses what cannot be honoured here, every
// such key in one message. The export carries a byte-level tokenizer for
// Hugging Face's AutoTokenizer (trainer/hf_export.cpp).
//
// What it leaves out: attention masks (every sequence is a full window of
// text, so there is no padding); a learned tokenizer (bytes are tokens).
//
// Build and run (see the Makefile):
//   make                         # nvcc if present, else mpicxx alone
//   make run                     # 2 ranks, stage 2, on the embedded corpus
//   mpirun -n 4 build/train_bert_mini --stage 2 --data my.txt --steps 500 --json out.json
//   build/train_bert_mini --help # every flag (trainer/settings.cpp)
//
// Tests #include this file with BERT_NO_MAIN defined (as llm.c's test_gpt2
// includes train_gpt2), so the model is tested exactly as it trains.
//
// Its parts, in order:
//   Data       corpus, windows, MLM masking (all keyed by (seed, step, sample))
//   Math       the Z2_HD math both backends share: GELU, LayerNorm, softmax,
//              dropout, cross-entropy
//   The model  parameters, activation memory (keep, recompute, offload),
//              buffers, initialization, forward, backward
//   Training   interrupts, the inputs, the run (setup, a step, evaluation,
//              the end); then main
#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// defines: Compute, Communicator, Engine, z2::Error and the Z2_HD math (the engine's API)
#include "zero2.h"
// defines: vocab_size and the special tokens, ModelShape, ActivationMode, TensorShapes;
// declares the model's sizes this file defines (parameter_numels, activation_peak_bytes)
#include "trainer/model_shape.h"
// defines: Settings, fail, agree_on_errors, first_bad_utf8, check_consistency, usage_text,
// engine_options, shape_of, mode_of, allocator_of
#include "trainer/settings.h"
// defines: read_regular_file, check_same_inputs
#include "trainer/inputs.h"
// defines: check_outputs, DirectoryLock (every output goes through write_output_file)
#include "trainer/output_files.h"
// defines: export_hf, BatchDump, write_batch_dump
#include "trainer/hf_export.h"
// defines: check_checkpoint_data, loaded_index_text, claim_save_directory, load_checkpoint,
// save_checkpoint, adopt_checkpoint
#include "trainer/checkpoints.h"
// defines: memory_block (the fit check), run_plan (--plan)
#include "trainer/plan.h"
// defines: InitialWeights, read_initial_weights (--init-hf)
#include "trainer/hf_import.h"
// defines: RunTrace, TracedStep, trace_keeps_parameters_after (--trace)
#include "trainer/trace.h"
// defines: RunRecord, StepRecord, print_header, ProgressLog, print_summary, write_json, write_memory_trace
#include "trainer/reports.h"
// defines: parse_command_line (argv and --config into Settings)
#include "trainer/command_line.h"
// defines: LaunchFacts, launch_facts, check_launch, check_local_rank (who started the processes)
#include "trainer/launcher.h"
// defines: StepObservers, ObservedModel, DrawnBatch, diverged (what watches a step)
#include "trainer/step_observers.h"

namespace bert {

constexpr float layer_norm_eps = 1e-12f;
constexpr float initializer_range = 0.02f;  // Hugging Face's normal(0, 0.02) init

// ----------------------------------------------------------------------------
// Data
//
// A sample is a window of T - 2 bytes of the corpus between [CLS] and [SEP].
// Global sample g = m * B + b of optimizer step s (m the global micro-batch)
// starts at a position drawn from hash(seed, step, g), and its masking from
// hash(seed, step, g, position): a pure function of (seed, s, m), whatever N, A or
// the rank that computes it: what makes 1x4 = 2x2 = 4x1 (notes/06).

enum Site : uint64_t {  // the first key after the seed: which random decision
  site_window = 1,
  site_select,
  site_action,
  site_random_byte,
  site_dropout = 16  // + 8 * layer + one of the dropout sites below
};
enum DropoutSite : uint64_t {
  dropout_embeddings,
  dropout_attention_probs,
  dropout_attention_output,
  dropout_ffn_output
};
constexpr uint64_t embeddings_layer = 1000;  // dropout key of the embeddings: above any block (--layers <= 256)

// The embedded default corpus, data/corpus.txt (trainer/embedded_corpus.cpp).
const std::string& default_corpus();

// The corpus: a regular file of UTF-8 text, non-empty, with no NUL byte (a
// binary file is almost certainly a mistake, not a corpus), at most 1 GiB
// (every rank holds all of it in memory).
constexpr size_t max_corpus_bytes = 1ull << 30;
inline std::string read_corpus(const std::string& path) {
  if (path.empty()) return default_corpus();
  const std::string text = read_regular_file("--data", path, max_corpus_bytes);
  if (text.empty()) fail("--data '%s' is empty", path.c_str());
  const size_t nul = text.find('\0');
  if (nul != std::string::npos)
    fail("--data '%s' has a NUL byte at offset %zu: it looks binary, not UTF-8 text", path.c_str(), nul);
  const size_t bad = first_bad_utf8(text);
  if (bad != std::string::npos)
    fail("--data '%s' is not UTF-8 text (an ill-formed sequence at offset %zu, byte 0x%02x)", path.c_str(), bad,
         (unsigned char)text[bad]);
  return text;
}

// One micro-batch on the host: tokens, which positions the loss reads, and
// the word-embedding gradient's gather lists.
struct Batch {
  std::vector<int> tokens;         // [B, T] input ids after masking
  std::vector<long> labels;        // [B, T] original byte where selected, -100 elsewhere (Hugging Face's convention)
  std::vector<int> selected;       // [S] flat positions b * T + t whose label counts, in order
  std::vector<int> targets;        // [S] their labels
  std::vector<int> token_offsets;  // [V + 1] compressed sparse rows (CSR) by token id: positions with token v are
  std::vector<int> token_rows;     //   token_rows[token_offsets[v] .. token_offsets[v + 1]), in order
};

// Sample `sample` of step `step`: fills row b of the batch.
inline void make_sample(const std::string& corpus, uint64_t seed, long step, long sample, int T, int b, Batch& batch) {
  const size_t window = (size_t)T - 2;
  const size_t starts = corpus.size() - window + 1;
  const size_t start = z2::hash_keys(seed, site_window, (uint64_t)step, (uint64_t)sample) % starts;
  int* tokens = batch.tokens.data() + (size_t)b * T;
  long* labels = batch.labels.data() + (size_t)b * T;
  tokens[0] = cls_token;
  tokens[T - 1] = sep_token;
  labels[0] = labels[T - 1] = -100;
  for (int t = 1; t + 1 < T; ++t) {
    const int byte = (unsigned char)corpus[start + t - 1];
    tokens[t] = byte;
    labels[t] = -100;
    // 15% of the positions are selected; of those 80% become [MASK], 10% a
    // random byte and 10% stay (BERT's recipe). [CLS] and [SEP] never are.
    float select =
        z2::uniform_from_hash(z2::hash_keys(seed, site_select, (uint64_t)step, (uint64_t)sample, (uint64_t)t));
    if (select >= 0.15f) continue;
    labels[t] = byte;
    float action =
        z2::uniform_from_hash(z2::hash_keys(seed, site_action, (uint64_t)step, (uint64_t)sample, (uint64_t)t));
    if (action < 0.8f) tokens[t] = mask_token;
    else if (action < 0.9f)
      tokens[t] = (int)(z2::hash_keys(seed, site_random_byte, (uint64_t)step, (uint64_t)sample, (uint64_t)t) % 256);
  }
}

inline Batch make_batch(const std::string& corpus, uint64_t seed, long step, long micro_batch, int B, int T) {
  Batch batch;
  batch.tokens.resize((size_t)B * T);
  batch.labels.resize((size_t)B * T);
  for (int b = 0; b < B; ++b) make_sample(corpus, seed, step, micro_batch * B + b, T, b, batch);
  for (int i = 0; i < B * T; ++i)
    if (batch.labels[i] >= 0) batch.selected.push_back(i), batch.targets.push_back((int)batch.labels[i]);
  // Counting sort of positions by token id, stable: each embedding row sums
  // its positions in increasing order.
  batch.token_offsets.assign(vocab_size + 1, 0);
  for (int token : batch.tokens) ++batch.token_offsets[token + 1];
  for (int v = 0; v < vocab_size; ++v) batch.token_offsets[v + 1] += batch.token_offsets[v];
  batch.token_rows.resize(batch.tokens.size());
  std::vector<int> next(batch.token_offsets.begin(), batch.token_offsets.end() - 1);
  for (int i = 0; i < B * T; ++i) batch.token_rows[next[batch.tokens[i]]++] = i;
  return batch;
}

// The loss is the mean over the selected positions of the whole global batch
// (all N x A micro-batches), so every rank needs that count. Each rank
// recomputes the masks of all M micro-batches (cheap hashes) instead of asking.
inline long global_selected_count(const std::string& corpus, uint64_t seed, long step, long micro_batches, int B,
                                  int T) {
  long count = 0;
  Batch scratch;
  scratch.tokens.resize((size_t)B * T);
  scratch.labels.resize((size_t)B * T);
  for (long m = 0; m < micro_batches; ++m)
    for (int b = 0; b < B; ++b) {
      make_sample(corpus, seed, step, m * B + b, T, b, scratch);
      for (int t = 0; t < T; ++t) count += scratch.labels[(size_t)b * T + t] >= 0;
    }
  return count;
}

// ----------------------------------------------------------------------------
// Math shared by the CPU loops and the CUDA kernels (Z2_HD)
//
// Each row function is written once over the storage type T: float in fp32
// training, z2::bfloat16 or z2::float16 in mixed precision. Whatever T is, the
// arithmetic is fp32: inputs are widened as they are read, and each result is
// rounded to T once, when it is stored (notes/08). With T = float the
// widening and rounding are identities, so fp32 keeps its bits.
using z2::from_float;
using z2::to_float;

// fmaxf(a, b) as glibc defines it (a NaN loses to a number; a tie returns a),
// written out so the compiler inlines it: fmaxf is a libm call at -O3.
Z2_HD inline float max_or_number(float a, float b) { return (a >= b || b != b) ? a : b; }

// GELU, erf form (Hugging Face "gelu"), and its derivative, both from
// 1 + erf(x / sqrt 2): forward can make the derivative with the erf it
// computes anyway (see linear_gelu).
Z2_HD inline float one_plus_erf(float x) { return 1.0f + z2::erf_fp32(x * 0.70710678118654752f); }
Z2_HD inline float gelu_from(float x, float one_plus_erf_x) { return x * 0.5f * one_plus_erf_x; }
Z2_HD inline float gaussian_exp(float x) { return z2::exp_fp32(-0.5f * x * x); }  // exp(-x^2 / 2)
Z2_HD inline float gelu_grad_from(float x, float one_plus_erf_x, float gaussian_exp_x) {
  const float cdf = 0.5f * one_plus_erf_x;
  const float pdf = gaussian_exp_x * 0.39894228040143268f;  // 1 / sqrt(2 pi)
  return cdf + x * pdf;
}
Z2_HD inline float gelu_grad(float x) { return gelu_grad_from(x, one_plus_erf(x), gaussian_exp(x)); }

// Inverted dropout: the scale an element is multiplied by, 0 or 1 / (1 - p),
// from the element's keys alone (notes/06, "Random numbers"). The keys are
// folded in three steps, each as often as it changes:
//   tensor key (seed, layer and site, step): once per dropout call, on the host;
//   row key: mix64(tensor key ^ global sample), once per sample (the CPU loop
//     hoists it out of the row; a CUDA thread computes it itself);
//   per element: two rounds of mix32, the row key's low half xor the element
//     index into the first and its high half into the second.
// The mask is a function of (seed, layer, site, step, sample, element) alone:
// the same at every N, rank and micro-batch split.
inline uint64_t dropout_tensor_key(uint64_t seed, uint64_t layer_site, long step) {
  return z2::hash_keys(seed, site_dropout + layer_site, (uint64_t)step);
}
Z2_HD inline uint64_t dropout_row_key(uint64_t tensor_key, long sample) {
  return z2::mix64(tensor_key ^ (uint64_t)sample);
}
Z2_HD inline float dropout_scale(float p, uint64_t row_key, uint32_t element) {
  const uint32_t bits = z2::mix32(z2::mix32((uint32_t)row_key ^ element) ^ (uint32_t)(row_key >> 32));
  return z2::uniform_from_hash32(bits) < p ? 0.0f : 1.0f / (1.0f - p);
}
// Dropout of one row of n elements that sit at `first_element` onwards in
// their sample (row_key): output[j] = input[j] x dropout_scale (output may be
// input). The attention's row passes call it next to the softmax, while the
// row is in cache.
template <class T>
Z2_HD inline void dropout_row(float p, uint64_t row_key, size_t first_element, const T* input, T* output, int n) {
  for (int j = 0; j < n; ++j)
    output[j] = from_float<T>(to_float(input[j]) * dropout_scale(p, row_key, (uint32_t)(first_element + j)));
}
// The dropout key of (layer, site): blocks 0..255, the embeddings 1000.
Z2_HD inline uint64_t dropout_key(uint64_t layer, uint64_t site) { return layer * 8 + site; }

// LayerNorm of one row of n: y = (x - mean) / sqrt(var + eps) * gamma + beta,
// with the biased variance, two passes (mean, then squared deviations), in
// index order. We keep mean and 1/sqrt(var + eps) for backward, in fp32 (as
// torch does for a 16-bit LayerNorm).
template <class T>
Z2_HD inline void layer_norm_row(const T* x, const T* gamma, const T* beta, int n, T* y, float* mean_out,
                                 float* rstd_out) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += to_float(x[j]);
  const float mean = sum / n;
  float squares = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float deviation = to_float(x[j]) - mean;
    squares += deviation * deviation;
  }
  const float rstd = 1.0f / sqrtf(squares / n + layer_norm_eps);
  for (int j = 0; j < n; ++j)
    y[j] = from_float<T>((to_float(x[j]) - mean) * rstd * to_float(gamma[j]) + to_float(beta[j]));
  *mean_out = mean;
  *rstd_out = rstd;
}
// dx of one row: with xhat = (x - mean) rstd and g = dy * gamma,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
template <class T>
Z2_HD inline void layer_norm_backward_row(const T* x, float mean, float rstd, const T* gamma, const T* dy, int n,
                                          T* dx) {
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float g = to_float(dy[j]) * to_float(gamma[j]);
    sum_g += g;
    sum_g_xhat += g * ((to_float(x[j]) - mean) * rstd);
  }
  const float mean_g = sum_g / n, mean_g_xhat = sum_g_xhat / n;
  for (int j = 0; j < n; ++j)
    dx[j] = from_float<T>(
        rstd * (to_float(dy[j]) * to_float(gamma[j]) - mean_g - (to_float(x[j]) - mean) * rstd * mean_g_xhat));
}

// Softmax of one row of n scores times `scale` (1/sqrt(D), applied after the
// product as torch does), in place (max subtracted for range). The scaled
// scores are formed in fp32 as each pass reads them, never stored.
// In fp32 the exponentials are stored in the row, summed, and divided in
// place: exp once per element, the bits of computing it twice.
// A 16-bit row cannot hold them unrounded, so there it is computed again.
// The max, in 8 lanes (element j in lane j % 8, then the lanes in order): a
// max is the same whatever the order, up to the sign of a zero, which
// x - max and exp cannot see; and a row of NaNs still gives row[0]'s. The
// lanes make 8 short dependency chains instead of one long one.
template <class T>
Z2_HD inline float scaled_row_max(const T* row, int n, float scale) {
  constexpr int lanes = 8;
  float lane_max[lanes];
  for (int k = 0; k < lanes; ++k) lane_max[k] = to_float(row[0]) * scale;
  int j = 1;
  for (; j + lanes <= n; j += lanes)
    for (int k = 0; k < lanes; ++k) lane_max[k] = max_or_number(lane_max[k], to_float(row[j + k]) * scale);
  float max_value = lane_max[0];
  for (int k = 1; k < lanes; ++k) max_value = max_or_number(max_value, lane_max[k]);
  for (; j < n; ++j) max_value = max_or_number(max_value, to_float(row[j]) * scale);
  return max_value;
}
template <class T>
Z2_HD inline void scaled_softmax_row(T* row, int n, float scale) {
  const float max_value = scaled_row_max(row, n, scale);
  float sum = 0.0f;
  if constexpr (std::is_same<T, float>::value) {
    // The exponentials in a loop of their own (it vectorises), then their
    // sum in order j = 0, 1, ... (a chain, as it always was).
    for (int j = 0; j < n; ++j) row[j] = z2::exp_fp32(row[j] * scale - max_value);
    for (int j = 0; j < n; ++j) sum += row[j];
    for (int j = 0; j < n; ++j) row[j] = row[j] / sum;
  } else {
    for (int j = 0; j < n; ++j) sum += z2::exp_fp32(to_float(row[j]) * scale - max_value);
    for (int j = 0; j < n; ++j) row[j] = from_float<T>(z2::exp_fp32(to_float(row[j]) * scale - max_value) / sum);
  }
}

// Softmax's backward on one row, with the scale after the product (as in
// forward): d_row holds dL/d probabilities in and dL/d scores out,
// dS = P (dP - rowsum(dP P)) / sqrt(D).
template <class T>
Z2_HD inline void softmax_backward_row(const T* p_row, T* d_row, int n, float scale) {
  float dot = 0.0f;
  for (int j = 0; j < n; ++j) dot += to_float(d_row[j]) * to_float(p_row[j]);
  for (int j = 0; j < n; ++j) d_row[j] = from_float<T>(to_float(p_row[j]) * (to_float(d_row[j]) - dot) * scale);
}

// Cross-entropy of one row of logits against `target`; writes the gradient
// (softmax - one_hot) * scale into dlogits (which may be logits itself) and
// returns -log softmax[target], in fp32.
template <class T>
Z2_HD inline float cross_entropy_row(const T* logits, int n, int target, float scale, T* dlogits) {
  float max_value = to_float(logits[0]);
  for (int j = 1; j < n; ++j) max_value = max_or_number(max_value, to_float(logits[j]));
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += z2::exp_fp32(to_float(logits[j]) - max_value);
  const float log_sum = z2::log_fp32(sum);
  const float loss = log_sum + max_value - to_float(logits[target]);  // read before dlogits may overwrite it
  for (int j = 0; j < n; ++j)
    dlogits[j] =
        from_float<T>((z2::exp_fp32(to_float(logits[j]) - max_value - log_sum) - (j == target ? 1.0f : 0.0f)) * scale);
  return loss;
}

// ----------------------------------------------------------------------------
// The model

// ModelShape, the vocabulary and the activation modes are in
// trainer/model_shape.h, for the plumbing that reads them.

// Parameter ids, registered in layer order (embeddings first, MLM head last)
// so that stage 2 can reduce a block's bucket while the blocks below are still
// in backward. Names are Hugging Face's, so an export needs no renaming.
struct BlockParameters {
  z2::ParameterId query_weight, query_bias, key_weight, key_bias, value_weight, value_bias;
  z2::ParameterId attention_output_weight, attention_output_bias, attention_norm_weight, attention_norm_bias;
  z2::ParameterId intermediate_weight, intermediate_bias, output_weight, output_bias, output_norm_weight,
      output_norm_bias;
};
struct Parameters {
  z2::ParameterId word_embeddings, position_embeddings, token_type_embeddings, embedding_norm_weight,
      embedding_norm_bias;
  std::vector<BlockParameters> blocks;
  z2::ParameterId head_dense_weight, head_dense_bias, head_norm_weight, head_norm_bias, decoder_bias;
};

// Parameter count of the model (the tensors registered below), from the
// shape alone, so train() can refuse a configuration that cannot fit before
// allocating anything.
inline size_t parameter_count(const ModelShape& s) {
  const size_t H = s.hidden, F = s.intermediate, V = vocab_size;
  const size_t block = 4 * (H * H + H) + 2 * H + (F * H + F) + (H * F + H) + 2 * H;
  return V * H + (size_t)s.max_positions * H + H + 2 * H + s.layers * block + (H * H + H) + 2 * H + V;
}

// --- activation memory (ZeRO-R, P_a and P_a+cpu: paper section 6.1) ----------
//
// What backward needs from forward, three ways (--activations):
//   keep       every intermediate of every block stays on the device until
//              the block's backward: L x W bytes, W = one block's working set.
//   recompute  only each block's input (its checkpoint, R x H floats) stays;
//              backward runs the block's forward again from it just before
//              the block's backward. Saves (L - 1) W bytes at the peak; costs
//              one more forward (about a third more compute).
//   offload    as recompute, but the checkpoints go to pinned host memory
//              while forward goes on (the copy stream) and come back one block
//              ahead of backward. The device holds one working set plus two
//              checkpoints, whatever L is; the host holds L - 1 checkpoints
//              (the last one is the first backward needs, so it stays).
// The bits are the same in all three: the recomputed forward is the same code
// on the same inputs with the same dropout keys. (ActivationMode: trainer/model_shape.h.)

// Activation bytes the model holds at once, for the fit check and for the
// tests that hold the ledger to it. The model's buffers, in elements (R = B T
// rows, S = B (T - 2) the most rows the head can select, A = B NH T T), of e
// bytes (4 in fp32, 2 in bf16 and fp16: every activation and activation
// gradient is stored in the precision's type) except the fp32 statistics:
//   always:      batch ints (2R + 2S + V + 1), per-row losses S (fp32)
//   per block:   W = 7 R H (q, k, v, context, two residual sums, attention_out)
//                  + A (probabilities) + 2 R F (FFN), + 4 R (LayerNorm stats, fp32)
//   backward:    the tied decoder's gradient V H, the gradient flowing down R H;
//                block scratch 2 R H + R max(2H, F) + A (+ A for dropped
//                probabilities when dropout is on)
//   head:        4 S H + S V forward, + 3 S H backward, + 2 S (stats, fp32)
// Buffers that live across blocks (checkpoints, kept blocks, the two backward
// buffers) are carved once by the arena (live from start-up) and allocated
// when first written by naive; temporaries are pushed and popped by both.
// (With keep, the last block's output is a temporary: see the Model.)
struct ActivationSizes {
  size_t always, working_set, checkpoint, embedding_sum, backward_long, block_scratch, recompute_scratch, head;
  size_t dropped;  // the dropped probabilities' temporary (0 without dropout)
};
// `round` (trainer/model_shape.h): live bytes, or a block's share. Each term
// below is one buffer (see the Model).
inline ActivationSizes activation_sizes(const ModelShape& s, BufferRound round = live_bytes) {
  const size_t B = s.micro_batch, T = s.seq, R = B * T, S = B * (T - 2), H = s.hidden, F = s.intermediate,
               V = vocab_size, scores = B * s.heads * T * T, dropped = s.dropout > 0.0f ? scores : 0, f = sizeof(float),
               i = sizeof(int), e = z2::element_bytes(s.precision);
  ActivationSizes sizes;
  // tokens, selected, targets, token offsets, token rows; per-row losses
  sizes.always = round(R * i) + round(S * i) + round(S * i) + round((V + 1) * i) + round(R * i) + round(S * f);
  // query, key, value, context, attention_sum, attention_out, output_sum; probs; ffn_gelu_saved, ffn_act; two stats
  sizes.working_set = 7 * round(R * H * e) + round(scores * e) + 2 * round(R * F * e) + 2 * round(2 * R * f);
  sizes.checkpoint = round(R * H * e);
  sizes.embedding_sum = round(R * H * e) + round(2 * R * f);
  sizes.backward_long = round(V * H * e) + round(R * H * e);  // decoder gradient, gradient flow
  // dsum, dattention, wide_scratch, dprobs, dropped
  sizes.block_scratch =
      2 * round(R * H * e) + round(R * std::max(2 * H, F) * e) + round(scores * e) + round(dropped * e);
  // The recomputed forward pushes dropped probabilities, pops them, then the
  // output it does not need: never both at once.
  sizes.recompute_scratch = std::max(round(dropped * e), round(R * H * e));
  sizes.head = 7 * round(S * H * e) + round(S * V * e) + round(2 * S * f);  // 7 [S, H], logits, stats
  sizes.dropped = round(dropped * e);
  return sizes;
}

// The most temporaries open at once when a block's working set is itself a
// temporary (recompute, offload): a block's backward (recomputed working set
// plus scratch), the head, or the embeddings' recomputation. (A block's
// forward, W + dropped probabilities, is never more: the scratch holds them too.)
inline size_t recomputing_temporaries(const ActivationSizes& z) {
  return std::max(
      {z.working_set + std::max(z.recompute_scratch, z.block_scratch), z.head, z.embedding_sum + z.checkpoint});
}

// The device activation peak (bytes) the ledger must show, by mode and
// allocator. Phase by phase: what is live while that phase's temporaries are.
size_t activation_peak_bytes(const ModelShape& s, ActivationMode mode, bool arena, BufferRound round) {
  const ActivationSizes z = activation_sizes(s, round);
  const size_t L = s.layers, dropped = z.dropped;
  // Buffers that live across blocks, all at once (the arena carves exactly these).
  size_t carved = z.backward_long;
  if (mode == ActivationMode::keep) carved += z.embedding_sum + L * (z.checkpoint + z.working_set);
  if (mode == ActivationMode::recompute) carved += (L + 1) * z.checkpoint;
  if (mode == ActivationMode::offload) carved += 2 * z.checkpoint;
  const size_t largest_temporary = mode == ActivationMode::keep
                                       ? std::max({dropped, z.checkpoint + z.head, z.block_scratch})
                                       : recomputing_temporaries(z);
  if (arena) return z.always + carved + largest_temporary;
  // naive: the long-lived buffers live only from first write to last read.
  const size_t C = z.checkpoint;
  size_t peak = 0;
  if (mode == ActivationMode::keep) {
    const size_t forward = z.embedding_sum + L * (C + z.working_set);  // before the head's input exists
    peak = std::max(
        {forward + dropped, forward + C + z.backward_long + z.head, forward + z.backward_long + z.block_scratch});
  } else {
    // checkpoints on the device: while the head runs, and in block L-1's backward
    const size_t head_checkpoints = mode == ActivationMode::recompute ? (L + 1) * C : std::min<size_t>(2, L + 1) * C;
    const size_t backward_checkpoints = mode == ActivationMode::recompute ? L * C : std::min<size_t>(2, L) * C;
    const size_t forward_checkpoints = mode == ActivationMode::recompute ? L * C : std::min<size_t>(1, L) * C;
    peak = std::max(
        {forward_checkpoints + z.working_set + std::max(dropped, C), head_checkpoints + z.backward_long + z.head,
         backward_checkpoints + z.backward_long + z.working_set + std::max(z.recompute_scratch, z.block_scratch)});
  }
  return z.always + peak;
}

// The bound offload promises (notes/04, "The bound"), from the configuration: one block's
// working set (its activations and backward scratch) plus two checkpoints,
// plus what every mode holds (the batch, the per-row losses, the two
// backward buffers). The head and the embeddings are smaller phases at any
// BERT-like size; the bound takes the largest phase all the same.
size_t offload_activation_bound(const ModelShape& s) {
  const ActivationSizes z = activation_sizes(s);
  return z.always + z.backward_long + 2 * z.checkpoint + recomputing_temporaries(z);
}

// How a parameter is initialized (Hugging Face's _init_weights).
enum class Init { normal, zeros, ones };

// Every parameter in registration order (first layer first: stage 2 then
// reduces the last layers' bucket while backward still works on the first),
// through `add(name, dims, decay, init)`, which returns its id. The model
// registers them with the engine; --plan only collects their sizes.
// Weight decay on linear weights and embeddings; none on biases and
// LayerNorm (Hugging Face's and DeepSpeed's default groups; notes/07).
template <class Add>
inline Parameters declare_parameters(const ModelShape& shape, Add add) {
  const long H = shape.hidden, F = shape.intermediate, V = vocab_size;
  Parameters ids;
  ids.word_embeddings = add("bert.embeddings.word_embeddings.weight", {V, H}, true, Init::normal);
  ids.position_embeddings =
      add("bert.embeddings.position_embeddings.weight", {shape.max_positions, H}, true, Init::normal);
  ids.token_type_embeddings = add("bert.embeddings.token_type_embeddings.weight", {1, H}, true, Init::normal);
  ids.embedding_norm_weight = add("bert.embeddings.LayerNorm.weight", {H}, false, Init::ones);
  ids.embedding_norm_bias = add("bert.embeddings.LayerNorm.bias", {H}, false, Init::zeros);
  for (int l = 0; l < shape.layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    BlockParameters b;
    b.query_weight = add(p + "attention.self.query.weight", {H, H}, true, Init::normal);
    b.query_bias = add(p + "attention.self.query.bias", {H}, false, Init::zeros);
    b.key_weight = add(p + "attention.self.key.weight", {H, H}, true, Init::normal);
    b.key_bias = add(p + "attention.self.key.bias", {H}, false, Init::zeros);
    b.value_weight = add(p + "attention.self.value.weight", {H, H}, true, Init::normal);
    b.value_bias = add(p + "attention.self.value.bias", {H}, false, Init::zeros);
    b.attention_output_weight = add(p + "attention.output.dense.weight", {H, H}, true, Init::normal);
    b.attention_output_bias = add(p + "attention.output.dense.bias", {H}, false, Init::zeros);
    b.attention_norm_weight = add(p + "attention.output.LayerNorm.weight", {H}, false, Init::ones);
    b.attention_norm_bias = add(p + "attention.output.LayerNorm.bias", {H}, false, Init::zeros);
    b.intermediate_weight = add(p + "intermediate.dense.weight", {F, H}, true, Init::normal);
    b.intermediate_bias = add(p + "intermediate.dense.bias", {F}, false, Init::zeros);
    b.output_weight = add(p + "output.dense.weight", {H, F}, true, Init::normal);
    b.output_bias = add(p + "output.dense.bias", {H}, false, Init::zeros);
    b.output_norm_weight = add(p + "output.LayerNorm.weight", {H}, false, Init::ones);
    b.output_norm_bias = add(p + "output.LayerNorm.bias", {H}, false, Init::zeros);
    ids.blocks.push_back(b);
  }
  ids.head_dense_weight = add("cls.predictions.transform.dense.weight", {H, H}, true, Init::normal);
  ids.head_dense_bias = add("cls.predictions.transform.dense.bias", {H}, false, Init::zeros);
  ids.head_norm_weight = add("cls.predictions.transform.LayerNorm.weight", {H}, false, Init::ones);
  ids.head_norm_bias = add("cls.predictions.transform.LayerNorm.bias", {H}, false, Init::zeros);
  ids.decoder_bias = add("cls.predictions.bias", {V}, false, Init::zeros);
  return ids;
}

// The parameters as registered, from the shape alone (for the plumbing:
// the plan lays out their sizes, --init-hf reads their names and shapes).
std::vector<ParameterTensor> parameter_tensors(const ModelShape& shape) {
  std::vector<ParameterTensor> tensors;
  declare_parameters(shape, [&](const std::string& name, const std::vector<long>& dims, bool decay, Init) {
    tensors.push_back({name, dims, decay});
    return (z2::ParameterId)(tensors.size() - 1);
  });
  return tensors;
}
std::vector<size_t> parameter_numels(const ModelShape& shape) {
  std::vector<size_t> numels;
  for (const ParameterTensor& tensor : parameter_tensors(shape)) numels.push_back(tensor.numel());
  return numels;
}

// One model buffer. The model opens it where a framework would allocate the
// tensor (its first write) and closes it after its last read; where the
// memory comes from depends on the allocator and on how long it lives:
//   long-lived (checkpoints, kept blocks, the backward's two long buffers):
//     arena: carved once at start-up (`carved`), open and close do nothing;
//     naive: allocated at open, released at close, from the free list;
//   temporary (one block's or the head's working set, scratch):
//     pushed at open and popped at close, in last-in-first-out order.
// The allocator sees only bytes; BufferOf<T> gives the model typed access.
struct Buffer {
  size_t count = 0;          // elements
  size_t element_bytes = 4;  // 4 (float), 2 (a 16-bit activation)
  bool long_lived = false;
  bool carved = false;      // arena: `storage` is fixed for the whole run
  void* storage = nullptr;  // while open (always, when carved)
  size_t bytes() const { return count * element_bytes; }
};
template <class T>
struct BufferOf : Buffer {
  BufferOf() { element_bytes = sizeof(T); }
  T* data() const { return static_cast<T*>(storage); }
};

// Activations of one block, kept from forward for backward, in the
// activation type `Act` (LayerNorm statistics in fp32). Shapes use R = B * T
// rows (every token of the micro-batch). The block's input x is its
// checkpoint (Model::checkpoints_[l]).
template <class Act>
struct BlockActivations {
  BufferOf<Act> query, key, value;  // [R, H]   heads side by side: head h is columns h*D .. h*D+D-1
  BufferOf<Act> probs;              // [B, NH, T, T] softmax before dropout
  BufferOf<Act> context;            // [R, H]   probs (after dropout) x value
  BufferOf<Act> attention_sum;      // [R, H]   x + dropout(dense(context)), LayerNorm's input
  BufferOf<float> attention_stats;  // [R, 2]   its mean and rstd
  BufferOf<Act> attention_out;      // [R, H]   LayerNorm output: the FFN's input and residual
  BufferOf<Act> ffn_gelu_saved;     // [R, F]   GELU' before the activation (fp32) or the pre-activation (16-bit)
  BufferOf<Act> ffn_act;            // [R, F]   after GELU
  BufferOf<Act> output_sum;         // [R, H]   attention_out + dropout(dense(ffn_act))
  BufferOf<float> output_stats;     // [R, 2]
  // In the order forward opens them (backward closes them in reverse).
  std::array<Buffer*, 12> in_order() {
    return {&query,           &key,           &value,          &probs,   &context,    &attention_sum,
            &attention_stats, &attention_out, &ffn_gelu_saved, &ffn_act, &output_sum, &output_stats};
  }
};

// The model, written once over its activation type: float (fp32), or
// z2::bfloat16 / z2::float16 (mixed precision: the engine's working
// parameters and gradients are that type too). train() picks one.
template <class Act>
class Model {
 public:
  // Construct after compute.use_allocator(): with the arena, the long-lived
  // buffers are carved here, before the engine's model states.
  Model(z2::Compute& compute, z2::Engine& engine, const ModelShape& shape, ActivationMode mode = ActivationMode::keep);
  ~Model();

  // After engine.build(): Hugging Face's initialization (normal(0, 0.02) for
  // weights and embeddings, zeros for biases, ones for LayerNorm weights),
  // drawn on the host in double from hash(seed, parameter, element) and
  // rounded once, so both backends and every N start from the same bits.
  void initialize();
  // Forward (and, when `backward`, backward with the gradients handed to the
  // engine) of one micro-batch. `loss_scale` is 1 / (selected positions in the
  // global batch). Returns this micro-batch's loss contribution: the sum over
  // its selected positions of loss / count, in the canonical tree. In fp16
  // the gradient also carries the engine's loss scale; the loss does not.
  float run(const Batch& batch, long step, long micro_batch, float loss_scale, bool backward);

  // wall_clock_breakdown: milliseconds run() spent in forward (embeddings
  // and blocks) and in backward (the MLM head's forward and backward, which
  // are one pass, then the blocks' and embeddings' backward), summed over
  // micro-steps until reset. Each boundary synchronizes the device, which
  // costs what the breakdown measures (DeepSpeed's timers synchronize too).
  struct Times {
    double forward_ms = 0, backward_ms = 0;
  };
  void time_phases(bool on) { timing_ = on; }
  // Evaluation: no dropout (torch's model.eval()); training's rate back after.
  void set_evaluation(bool on) {
    if (on) training_dropout_ = shape_.dropout, shape_.dropout = 0.0f;
    else shape_.dropout = training_dropout_;
  }
  Times take_times() { return std::exchange(times_, Times{}); }

  const Parameters& ids() const { return ids_; }
  const ModelShape& shape() const { return shape_; }
  // Tensor shape of parameter `id` as Hugging Face stores it, and all of
  // them (what the export, the dump and a checkpoint's index need of the model).
  const std::vector<long>& tensor_shape(z2::ParameterId id) const { return shapes_[id]; }
  const TensorShapes& tensor_shapes() const { return shapes_; }

  // The steps of run(). Public only because nvcc does not allow extended
  // (__host__ __device__) lambdas inside private member functions.
  z2::ParameterId add(const std::string& name, std::vector<long> shape, bool decay, Init init);
  Act* param(z2::ParameterId id) { return engine_.template parameter_as<Act>(id); }
  Act* gradient(z2::ParameterId id) { return engine_.template gradient_output_as<Act>(id); }
  void upload(const Batch& batch);
  void embeddings_forward(long step, long first_sample, Act* x0);
  void block_forward(int layer, long step, long first_sample, BufferOf<Act>& output);
  void head_forward_backward(long step, float gradient_scale, bool backward);
  float loss_contribution(float loss_scale);
  void block_backward(int layer, long step, long first_sample);
  void embeddings_backward(long step, long first_sample);
  // Where buffers come from (see Buffer), and the checkpoints' trips to the host.
  void* open_storage(Buffer& buffer);
  template <class T>
  T* open(BufferOf<T>& buffer) {
    return static_cast<T*>(open_storage(buffer));
  }
  void close(Buffer& buffer);
  void open_block(BlockActivations<Act>& block);
  void close_block(BlockActivations<Act>& block);
  BlockActivations<Act>& block(int layer) { return blocks_[mode_ == ActivationMode::keep ? layer : 0]; }
  void offload(int checkpoint);   // device -> host, on the copy stream
  void prefetch(int checkpoint);  // host -> device, on the copy stream
  ActivationMode mode() const { return mode_; }
  // Small building blocks (under "building blocks" below).
  void matmul_bias(const Act* input, const Act* weight, const Act* bias, int rows, int in, int out, Act* output);
  void linear(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in, int out, Act* output);
  void linear_gelu(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in, int out,
                   Act* gelu_saved, Act* act);
  void gelu_backward(const Act* gelu_saved, size_t count, Act* dact);
  void linear_dropout_residual(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                               int out, const Act* residual, Act* output, long step, long first_sample, uint64_t key);
  void linear_backward(const Act* input, const Act* doutput, z2::ParameterId weight, z2::ParameterId bias, int rows,
                       int in, int out, Act* dinput, float dinput_beta);
  void column_sums(const Act* matrix, int rows, int columns, Act* sums);
  void layer_norm(const Act* x, z2::ParameterId weight, z2::ParameterId bias, int rows, Act* y, float* stats);
  void layer_norm_backward(const Act* x, const float* stats, const Act* dy, z2::ParameterId weight,
                           z2::ParameterId bias, int rows, Act* dx);
  void dropout(const Act* input, Act* output, size_t count, size_t per_sample, long step, long first_sample,
               uint64_t key);

 private:
  z2::Compute& compute_;
  bool timing_ = false;
  float training_dropout_ = 0.0f;
  Times times_;
  std::chrono::steady_clock::time_point phase_start_;
  // The phase that ends now, timed from the last boundary (wall_clock_breakdown only).
  void end_phase(double Times::*phase) {
    if (!timing_) return;
    compute_.synchronize_all();
    const auto now = std::chrono::steady_clock::now();
    times_.*phase += std::chrono::duration<double, std::milli>(now - phase_start_).count();
    phase_start_ = now;
  }
  z2::Engine& engine_;
  ModelShape shape_;
  ActivationMode mode_;
  Parameters ids_;
  TensorShapes shapes_;
  std::vector<Init> inits_;

  // Device copies of the batch, and the per-row losses: allocated once, as
  // they live through every micro-step.
  z2::DeviceArray<int> tokens_, selected_, targets_, token_offsets_, token_rows_;
  z2::DeviceArray<float> sample_loss_;  // [S] fp32 in every precision
  int selected_count_ = 0;
  // Checkpoint l is block l's input ([R, H]); checkpoint L is the last
  // block's output, the head's input. Long-lived in every mode.
  std::vector<BufferOf<Act>> checkpoints_;
  BufferOf<Act> embedding_sum_;                // [R, H] long-lived with keep, a temporary otherwise
  BufferOf<float> embedding_stats_;            // [R, 2] likewise
  std::vector<BlockActivations<Act>> blocks_;  // keep: one per layer, long-lived; else one working set, temporary
  BufferOf<Act> head_input_, head_gelu_saved_, head_act_,
      head_out_;                                          // [S, H] temporaries (S = the most rows the head can select)
  BufferOf<float> head_stats_;                            // [S, 2]
  BufferOf<Act> logits_;                                  // [S, V]
  BufferOf<Act> head_dout_, head_dact_, head_dgathered_;  // [S, H] the head's backward
  // Long-lived through backward: the tied decoder's part of dL/d
  // word_embeddings [V, H], and dL/d the current block's output [R, H].
  BufferOf<Act> decoder_gradient_, gradient_flow_;
  // Backward scratch of one block (temporaries).
  BufferOf<Act> dsum_, dattention_;  // [R, H]
  BufferOf<Act> wide_scratch_;       // [R, max(2H, F)]: d ffn, later dq and dk side by side
  BufferOf<Act> dropped_, dprobs_;   // [B, NH, T, T] dropped probabilities (dropout only), d probabilities
  BufferOf<Act> recomputed_output_;  // [R, H] the output a recomputed forward writes and nobody reads
  // The arena's carved memory (freed when the model goes), and for offload
  // the host copies of checkpoints 0 .. L-2 (pinned) and their events.
  std::vector<z2::DeviceArray<char>> carved_;
  Act* host_checkpoints_ = nullptr;  // [L - 1, R, H]
  std::vector<z2::Event> produced_, offloaded_, prefetched_;
  std::vector<char> fetched_;  // checkpoint c is back on the device in this backward (offload)
  z2::Event slot_free_;
};

template <class Act>
inline z2::ParameterId Model<Act>::add(const std::string& name, std::vector<long> shape, bool decay, Init init) {
  size_t numel = 1;
  for (long d : shape) numel *= (size_t)d;
  z2::ParameterId id = engine_.add_parameter(name, numel, decay);
  shapes_.push_back(shape);
  inits_.push_back(init);
  return id;
}

template <class Act>
inline Model<Act>::Model(z2::Compute& compute, z2::Engine& engine, const ModelShape& shape, ActivationMode mode)
    : compute_(compute), engine_(engine), shape_(shape), mode_(mode) {
  const long H = shape.hidden, F = shape.intermediate, V = vocab_size;
  ids_ = declare_parameters(shape, [&](const std::string& name, std::vector<long> dims, bool decay, Init init) {
    return add(name, std::move(dims), decay, init);
  });

  if (shape.precision != z2::precision_of<Act>() || engine.precision() != shape.precision)
    fail("the model's activations (%s), its shape's precision (%s) and the engine's (%s) must agree",
         z2::to_string(z2::precision_of<Act>()), z2::to_string(shape.precision), z2::to_string(engine.precision()));
  // Activation buffers. R rows of the micro-batch; at most S = B (T - 2)
  // selected rows reach the head. Every rank makes the same requests in the
  // same order (the head's buffers are sized for S whatever the batch
  // selected), so an out-of-memory is met by all ranks at the same request.
  const size_t B = shape.micro_batch, T = shape.seq, R = B * T, S = B * (T - 2);
  const size_t attention = B * shape.heads * T * T;
  auto ints = [&](size_t count) { return z2::DeviceArray<int>(compute, count, z2::MemoryKind::activations); };
  tokens_ = ints(R), selected_ = ints(S), targets_ = ints(S), token_offsets_ = ints(V + 1), token_rows_ = ints(R);
  sample_loss_ = z2::DeviceArray<float>(compute, S, z2::MemoryKind::activations);
  const bool keep = mode == ActivationMode::keep;
  auto sized = [](Buffer& buffer, size_t count, bool long_lived) {
    buffer.count = count, buffer.long_lived = long_lived;
  };
  checkpoints_.resize(shape.layers + 1);
  for (auto& checkpoint : checkpoints_) sized(checkpoint, R * H, true);
  // With keep, the last block's output lives only from its LayerNorm to the
  // end of the head, while no other temporary is open: a stack entry. (In
  // the other modes that block's working set is still pushed when it is made.)
  if (keep) checkpoints_[shape.layers].long_lived = false;
  sized(embedding_sum_, R * H, keep), sized(embedding_stats_, R * 2, keep);
  blocks_.resize(keep ? shape.layers : 1);
  for (auto& a : blocks_) {
    sized(a.query, R * H, keep), sized(a.key, R * H, keep), sized(a.value, R * H, keep);
    sized(a.probs, attention, keep), sized(a.context, R * H, keep);
    sized(a.attention_sum, R * H, keep), sized(a.attention_stats, R * 2, keep), sized(a.attention_out, R * H, keep);
    sized(a.ffn_gelu_saved, R * F, keep), sized(a.ffn_act, R * F, keep);
    sized(a.output_sum, R * H, keep), sized(a.output_stats, R * 2, keep);
  }
  for (Buffer* b :
       {&head_input_, &head_gelu_saved_, &head_act_, &head_out_, &head_dout_, &head_dact_, &head_dgathered_})
    sized(*b, S * H, false);
  sized(head_stats_, S * 2, false), sized(logits_, S * V, false);
  sized(decoder_gradient_, V * H, true), sized(gradient_flow_, R * H, true);
  sized(dsum_, R * H, false), sized(dattention_, R * H, false), sized(wide_scratch_, R * std::max(2 * H, F), false);
  sized(dropped_, attention, false), sized(dprobs_, attention, false), sized(recomputed_output_, R * H, false);

  if (compute.allocator() == z2::Allocator::arena) {
    // The arena's region for long-lived activations: carve each one once.
    // With offload only two checkpoints are ever on the device at once
    // (checkpoint c uses slot c mod 2), so two slots serve all L + 1.
    auto carve = [&](Buffer& buffer) {
      carved_.emplace_back(compute, buffer.bytes(), z2::MemoryKind::activations);
      buffer.storage = carved_.back().data(), buffer.carved = true;
    };
    if (mode == ActivationMode::offload) {
      for (int slot = 0; slot < 2 && slot <= shape.layers; ++slot) carve(checkpoints_[slot]);
      for (int c = 2; c <= shape.layers; ++c)
        checkpoints_[c].storage = checkpoints_[c % 2].storage, checkpoints_[c].carved = true;
    } else {
      for (auto& checkpoint : checkpoints_)
        if (checkpoint.long_lived) carve(checkpoint);
    }
    if (keep) {
      carve(embedding_sum_), carve(embedding_stats_);
      for (auto& a : blocks_)
        for (Buffer* b : a.in_order()) carve(*b);
    }
    carve(decoder_gradient_), carve(gradient_flow_);
  }
  if (mode == ActivationMode::offload) {
    // Host copies of checkpoints 0 .. L-2: the last one (L-1) is still on the
    // device when backward starts, and backward needs it first.
    if (shape.layers >= 2)
      host_checkpoints_ = (Act*)compute.allocate_host_pinned((size_t)(shape.layers - 1) * R * H * sizeof(Act), true);
    for (int c = 0; c <= shape.layers; ++c)
      produced_.push_back(compute.create_event()), offloaded_.push_back(compute.create_event()),
          prefetched_.push_back(compute.create_event());
    slot_free_ = compute.create_event();
    fetched_.assign(shape.layers >= 2 ? shape.layers - 1 : 0, 0);
  }
}

template <class Act>
inline Model<Act>::~Model() {
  compute_.synchronize_all();
  for (auto* events : {&produced_, &offloaded_, &prefetched_})
    for (z2::Event event : *events) compute_.destroy_event(event);
  if (slot_free_.handle) compute_.destroy_event(slot_free_);
  if (host_checkpoints_) compute_.release_host_pinned(host_checkpoints_);
  // Carved buffers go back in reverse order. (The arena reuses none of it:
  // the engine's buffers were carved above them.)
  while (!carved_.empty()) carved_.pop_back();
}

// --- where buffers come from -------------------------------------------------

template <class Act>
inline void* Model<Act>::open_storage(Buffer& buffer) {
  if (buffer.carved) return buffer.storage;
  buffer.storage = buffer.long_lived ? compute_.allocate(buffer.bytes(), z2::MemoryKind::activations)
                                     : compute_.push(buffer.bytes(), z2::MemoryKind::activations);
  return buffer.storage;
}

template <class Act>
inline void Model<Act>::close(Buffer& buffer) {
  if (buffer.carved || !buffer.storage) return;
  if (buffer.long_lived) compute_.release(buffer.storage);
  else compute_.pop(buffer.storage);
  buffer.storage = nullptr;
}

template <class Act>
inline void Model<Act>::open_block(BlockActivations<Act>& block) {
  for (Buffer* b : block.in_order()) open_storage(*b);
}

template <class Act>
inline void Model<Act>::close_block(BlockActivations<Act>& block) {
  auto buffers = block.in_order();
  for (auto b = buffers.rbegin(); b != buffers.rend(); ++b) close(**b);
}

// Checkpoint c (0 <= c <= L-2) to the host, once forward has written it: the
// copy stream waits for the compute stream's event, then copies while the
// next block computes (z2::checkpoint_copy, zero2.cu: the streams lab's
// seam). On cpu the copy happens at once (into host memory that plays the
// role of pinned memory).
template <class Act>
inline void Model<Act>::offload(int c) {
  fetched_[c] = 0;
  const size_t count = checkpoints_[c].count;
  z2::checkpoint_copy(compute_, host_checkpoints_ + (size_t)c * count, checkpoints_[c].data(), checkpoints_[c].bytes(),
                      produced_[c], offloaded_[c]);
}

// Checkpoint c back to the device, one block ahead of its backward. Its slot
// (arena) or fresh memory (naive) was last used by work on the compute
// stream: the copy waits for that, and block c's backward waits for the copy.
template <class Act>
inline void Model<Act>::prefetch(int c) {
  if (c > (int)fetched_.size() - 1 || fetched_[c])
    z2::usage_error(
        "offload: checkpoint %d cannot be brought back now: only checkpoints 0 .. %d go to the host, "
        "each once per backward",
        c, (int)fetched_.size() - 1);
  fetched_[c] = 1;
  const size_t count = checkpoints_[c].count;
  open(checkpoints_[c]);
  z2::checkpoint_copy(compute_, checkpoints_[c].data(), host_checkpoints_ + (size_t)c * count, checkpoints_[c].bytes(),
                      slot_free_, prefetched_[c]);
}

template <class Act>
inline void Model<Act>::initialize() {
  std::vector<float> values;
  values.reserve(engine_.psi());
  const auto& infos = engine_.parameters();
  for (size_t id = 0; id < infos.size(); ++id)
    for (size_t i = 0; i < infos[id].numel; ++i) {
      // Hugging Face zeroes the [PAD] row of the word embeddings (padding_idx).
      const bool pad_row = (int)id == ids_.word_embeddings && i / shape_.hidden == (size_t)pad_token;
      if (inits_[id] != Init::normal || pad_row) {
        values.push_back(inits_[id] == Init::ones ? 1.0f : 0.0f);
        continue;
      }
      // Box-Muller from two 53-bit uniforms in double: host-only, so the same
      // bits on every backend, and with zero2's log and cos (zero2.h), not
      // libm's, so on every machine. u1 in (0, 1] keeps the logarithm finite.
      uint64_t h1 = z2::hash_keys(shape_.seed, 0x1417, id, i, 1), h2 = z2::hash_keys(shape_.seed, 0x1417, id, i, 2);
      double u1 = ((h1 >> 11) + 1) * (1.0 / 9007199254740992.0), u2 = (h2 >> 11) * (1.0 / 9007199254740992.0);
      double normal = std::sqrt(-2.0 * z2::log_double(u1)) * z2::cos_two_pi(u2);
      values.push_back((float)(normal * initializer_range));
    }
  engine_.parameters_from_host(values);
}

// --- building blocks ---------------------------------------------------------

// output [rows, out] = input [rows, in] x W^T + b, with W [out, in] (torch's
// Linear, and the tied decoder). fp32: the product, then the bias added (the
// bits zero2 has always had). 16-bit: the bias first, then the product with
// beta = 1, so x W^T + b is summed in fp32 and rounded once, as torch's addmm
// (cuBLAS's epilogue) does; a separate bias add would round twice.
template <class Act>
inline void Model<Act>::matmul_bias(const Act* input, const Act* weight, const Act* bias, int rows, int in, int out,
                                    Act* output) {
  if constexpr (std::is_same<Act, float>::value) {
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, weight, in, 0.0f, output, out);
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, { output[r * out + j] += bias[j]; }));
  } else {
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, { output[r * out + j] = bias[j]; }));
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, weight, in, 1.0f, output, out);
  }
}
template <class Act>
inline void Model<Act>::linear(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                               int out, Act* output) {
  matmul_bias(input, param(weight), param(bias), rows, in, out, output);
}

// The two fused forms below are linear() and the pass that follows it in a
// block, with the bias added in that pass (fp32; in 16-bit it is in the
// product, as in matmul_bias): one pass over the output instead of two or
// three, each value rounded exactly as the separate passes round it.
// act [rows, out] = GELU(pre), pre = input x W^T + b, and gelu_saved [rows,
// out] = what GELU's backward reads (as PyTorch's autograd saves a tensor
// for it). fp32: GELU'(pre), made here from the same 1 + erf(pre / sqrt 2)
// as GELU(pre), so backward calls no erf (one of the two per element; the
// same bits as computing it there). 16-bit: pre itself, because GELU'
// rounded to 16 bits would change the gradient's bits.
template <class Act>
inline void Model<Act>::linear_gelu(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                                    int out, Act* gelu_saved, Act* act) {
  constexpr bool fp32 = std::is_same<Act, float>::value;
  const Act* b = param(bias);
  if (fp32) {
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, param(weight), in, 0.0f, act, out);  // act = x W^T
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, {
                        const size_t i = r * out + j;
                        const float pre = to_float(act[i]) + to_float(b[j]);
                        const float ope = one_plus_erf(pre);
                        act[i] = from_float<Act>(gelu_from(pre, ope));
                        gelu_saved[i] = from_float<Act>(gelu_grad_from(pre, ope, gaussian_exp(pre)));
                      }));
  } else {
    matmul_bias(input, param(weight), b, rows, in, out, gelu_saved);  // pre, bias in the product
    compute_.for_each((size_t)rows * out, Z2_LOOP(i, {
                        const float pre = to_float(gelu_saved[i]);
                        act[i] = from_float<Act>(gelu_from(pre, one_plus_erf(pre)));
                      }));
  }
}
// dact [count] *= GELU'(pre), from linear_gelu's gelu_saved.
template <class Act>
inline void Model<Act>::gelu_backward(const Act* gelu_saved, size_t count, Act* dact) {
  if constexpr (std::is_same<Act, float>::value)
    compute_.for_each(count, Z2_LOOP(i, { dact[i] = dact[i] * gelu_saved[i]; }));
  else
    compute_.for_each(
        count, Z2_LOOP(i, { dact[i] = from_float<Act>(to_float(dact[i]) * gelu_grad(to_float(gelu_saved[i]))); }));
}
// output [rows, out] = residual + dropout(input x W^T + b), the sublayer
// output of a post-LN block (rows are positions, T per sample; `key` the
// dropout site's).
template <class Act>
inline void Model<Act>::linear_dropout_residual(const Act* input, z2::ParameterId weight, z2::ParameterId bias,
                                                int rows, int in, int out, const Act* residual, Act* output, long step,
                                                long first_sample, uint64_t key) {
  constexpr bool bias_in_pass = std::is_same<Act, float>::value;
  const Act* b = param(bias);
  if (bias_in_pass) compute_.gemm(false, true, rows, out, in, 1.0f, input, in, param(weight), in, 0.0f, output, out);
  else matmul_bias(input, param(weight), b, rows, in, out, output);
  const float rate = shape_.dropout;
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, key, step);
  const size_t T = (size_t)shape_.seq;
  compute_.for_each(
      (size_t)rows, (size_t)out, Z2_LOOP2(r, j, {
        const size_t i = r * out + j;
        // No branch on the rate: at 0 the scale is exactly 1 and the rounding
        // changes nothing, and a branch-free body is one the CPU loop vectorises.
        const uint64_t row_key = dropout_row_key(tensor_key, first_sample + (long)(r / T));
        float value = to_float(output[i]);
        if (bias_in_pass) value = value + to_float(b[j]);
        value = to_float(from_float<Act>(value * dropout_scale(rate, row_key, (uint32_t)((r % T) * out + j))));
        output[i] = from_float<Act>(value + to_float(residual[i]));
      }));
}

// sums [columns] = the sum over rows of matrix [rows, columns], each column's
// rows added in order (the fixed-order reduction that replaces atomics for
// bias and LayerNorm gradients; Compute::column_sums says how each backend
// runs it).
template <class Act>
inline void Model<Act>::column_sums(const Act* matrix, int rows, int columns, Act* sums) {
  compute_.column_sums((size_t)rows, (size_t)columns, Z2_LOOP2(r, j, { return to_float(matrix[r * columns + j]); }),
                       sums);
}

// Given doutput [rows, out]: db = column sums and dW [out, in] = doutput^T x
// input go to the engine (bias first: the reverse of registration order);
// dinput [rows, in] = doutput x W (+ dinput_beta x dinput, so three
// projections can add into one dinput in a fixed order).
template <class Act>
inline void Model<Act>::linear_backward(const Act* input, const Act* doutput, z2::ParameterId weight,
                                        z2::ParameterId bias, int rows, int in, int out, Act* dinput,
                                        float dinput_beta) {
  column_sums(doutput, rows, out, gradient(bias));
  engine_.gradient_ready(bias);
  compute_.gemm(true, false, out, in, rows, 1.0f, doutput, out, input, in, 0.0f, gradient(weight), in);
  engine_.gradient_ready(weight);
  if (dinput)
    compute_.gemm(false, false, rows, in, out, 1.0f, doutput, out, param(weight), in, dinput_beta, dinput, in);
}

template <class Act>
inline void Model<Act>::layer_norm(const Act* x, z2::ParameterId weight, z2::ParameterId bias, int rows, Act* y,
                                   float* stats) {
  const int n = shape_.hidden;
  const Act *gamma = param(weight), *beta = param(bias);
  compute_.for_each((size_t)rows, Z2_LOOP(r, {
                      layer_norm_row(x + r * n, gamma, beta, n, y + r * n, stats + 2 * r, stats + 2 * r + 1);
                    }));
}

// dx [rows, H] from dy; dbeta = sum_rows dy and dgamma = sum_rows dy * xhat go
// to the engine (one thread per column, rows in order; bias first as above).
template <class Act>
inline void Model<Act>::layer_norm_backward(const Act* x, const float* stats, const Act* dy, z2::ParameterId weight,
                                            z2::ParameterId bias, int rows, Act* dx) {
  const int n = shape_.hidden;
  const Act* gamma = param(weight);
  column_sums(dy, rows, n, gradient(bias));
  engine_.gradient_ready(bias);
  compute_.column_sums((size_t)rows, (size_t)n,
                       Z2_LOOP2(r, j,
                                {
                                  return to_float(dy[r * n + j]) *
                                         ((to_float(x[r * n + j]) - stats[2 * r]) * stats[2 * r + 1]);  // dy * xhat
                                }),
                       gradient(weight));
  engine_.gradient_ready(weight);
  compute_.for_each((size_t)rows, Z2_LOOP(r, {
                      layer_norm_backward_row(x + r * n, stats[2 * r], stats[2 * r + 1], gamma, dy + r * n, n,
                                              dx + r * n);
                    }));
}

// output [B, per_sample] = input x dropout scale, keyed by (sample, key,
// element in sample); output may be input. Backward calls the same function
// on the gradient: the mask is recomputed, not stored. Out of place it is one
// pass (a plain copy when p = 0), not a copy and then a scaling pass.
template <class Act>
inline void Model<Act>::dropout(const Act* input, Act* output, size_t count, size_t per_sample, long step,
                                long first_sample, uint64_t key) {
  const float p = shape_.dropout;
  if (p == 0.0f) {
    compute_.copy(output, input, count * sizeof(Act), compute_.compute_stream());  // nothing if in place
    return;
  }
  if (per_sample > UINT32_MAX)
    z2::usage_error("dropout over %zu elements per sample: the mask's element key is 32 bits (at most %u)", per_sample,
                    UINT32_MAX);
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, key, step);
  compute_.for_each(count / per_sample, per_sample, Z2_LOOP2(sample, element, {
                      const size_t i = sample * per_sample + element;
                      const uint64_t row_key = dropout_row_key(tensor_key, first_sample + (long)sample);
                      output[i] = from_float<Act>(to_float(input[i]) * dropout_scale(p, row_key, (uint32_t)element));
                    }));
}

// --- forward -----------------------------------------------------------------

template <class Act>
inline void Model<Act>::upload(const Batch& batch) {
  z2::Stream stream = compute_.compute_stream();
  selected_count_ = (int)batch.selected.size();
  compute_.copy(tokens_.data(), batch.tokens.data(), batch.tokens.size() * sizeof(int), stream);
  compute_.copy(selected_.data(), batch.selected.data(), batch.selected.size() * sizeof(int), stream);
  compute_.copy(targets_.data(), batch.targets.data(), batch.targets.size() * sizeof(int), stream);
  compute_.copy(token_offsets_.data(), batch.token_offsets.data(), batch.token_offsets.size() * sizeof(int), stream);
  compute_.copy(token_rows_.data(), batch.token_rows.data(), batch.token_rows.size() * sizeof(int), stream);
}

// x0 = dropout(LayerNorm(word[token] + position[t] + token_type[0])) into
// `x0`; the sum and its LayerNorm stats into embedding_sum_ and
// embedding_stats_, which the caller has opened.
template <class Act>
inline void Model<Act>::embeddings_forward(long step, long first_sample, Act* x0) {
  const int H = shape_.hidden, T = shape_.seq, R = shape_.micro_batch * T;
  const int* tokens = tokens_.data();                       // [R] token ids, row r = sample r / T, position r % T
  const Act *word = param(ids_.word_embeddings),            // [V, H]
      *position = param(ids_.position_embeddings),          // [P, H], rows 0..T-1 used
          *token_type = param(ids_.token_type_embeddings);  // [1, H]: every token is type 0
  Act* sum = embedding_sum_.data();                         // [R, H] LayerNorm's input, for backward
  compute_.for_each((size_t)R, (size_t)H, Z2_LOOP2(row, j, {
                      sum[row * H + j] =
                          from_float<Act>(to_float(word[(size_t)tokens[row] * H + j]) +
                                          to_float(position[(row % T) * H + j]) + to_float(token_type[j]));
                    }));
  layer_norm(sum, ids_.embedding_norm_weight, ids_.embedding_norm_bias, R, x0, embedding_stats_.data());
  dropout(x0, x0, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(embeddings_layer, dropout_embeddings));
}

// One post-LN block: a = LN(x + drop(attn(x) Wo + bo)), y = LN(a + drop(gelu(a Wi + bi) Wf + bf)).
// x is checkpoint l; the block's buffers are open; `output` [R, H] receives y
// (checkpoint l + 1, or a scratch buffer when backward recomputes the block).
// We open `output` only when its LayerNorm runs, as a framework allocates a
// result when the operation that makes it runs: with the naive allocator the
// long-lived checkpoint then lands above this block's temporaries.
template <class Act>
inline void Model<Act>::block_forward(int l, long step, long first_sample, BufferOf<Act>& output) {
  const int B = shape_.micro_batch, T = shape_.seq, H = shape_.hidden, NH = shape_.heads, D = shape_.head_dim(),
            F = shape_.intermediate, R = B * T;
  const BlockParameters& p = ids_.blocks[l];
  BlockActivations<Act>& a = block(l);    // this block's activations (shapes in BlockActivations)
  const Act* x = checkpoints_[l].data();  // [R, H] the block's input
  linear(x, p.query_weight, p.query_bias, R, H, H, a.query.data());
  linear(x, p.key_weight, p.key_bias, R, H, H, a.key.data());
  linear(x, p.value_weight, p.value_bias, R, H, H, a.value.data());

  // Scores [T, T] per (sample, head) = Q K^T, then / sqrt(D) and softmax, a
  // row per thread. Q of head h is the D columns at h*D of a [T, H] slab.
  // One batched product per sample, the heads being the batch (stride D in
  // Q, K, V; stride T x T in the scores).
  const size_t scores_per_head = (size_t)T * T;
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, true, T, T, D, 1.0f, a.query.data() + rows, H, D, a.key.data() + rows, H, D, 0.0f,
                          a.probs.data() + square, T, (long)scores_per_head, NH);
  }
  Act* probs = a.probs.data();  // [B, NH, T, T]: scores now, probabilities after the softmax
  // torch divides the scores by sqrt(D) after the product; so do we (a
  // separate rounding, not folded into the gemm's alpha).
  const float inverse_sqrt = 1.0f / sqrtf((float)D);
  // Softmax and, in the same pass over the row, dropout on the probabilities
  // into a temporary (probs stays for backward).
  const float rate = shape_.dropout;
  Act* dropped = rate > 0.0f ? open(dropped_) : nullptr;  // [B, NH, T, T]
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, dropout_key(l, dropout_attention_probs), step);
  const size_t rows_per_sample = (size_t)NH * T;
  compute_.for_each((size_t)B * NH * T, Z2_LOOP(row, {
                      Act* row_probs = probs + row * T;
                      scaled_softmax_row(row_probs, T, inverse_sqrt);
                      if (dropped)
                        dropout_row(rate, dropout_row_key(tensor_key, first_sample + (long)(row / rows_per_sample)),
                                    (row % rows_per_sample) * T, row_probs, dropped + row * T, T);
                    }));
  const Act* source = dropped ? dropped : probs;  // what multiplies V: probs, or their dropped copy
  // Context [T, D] per (sample, head) = probs x V, into the head's columns.
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, false, T, D, T, 1.0f, source + square, T, (long)scores_per_head, a.value.data() + rows,
                          H, D, 0.0f, a.context.data() + rows, H, D, NH);
  }
  if (dropped) close(dropped_);
  // Attention output: dense, dropout, residual, LayerNorm.
  Act* sum = a.attention_sum.data();  // [R, H] x + dropout(context Wo^T + bo), kept for LayerNorm's backward
  linear_dropout_residual(a.context.data(), p.attention_output_weight, p.attention_output_bias, R, H, H, x, sum, step,
                          first_sample, dropout_key(l, dropout_attention_output));
  layer_norm(sum, p.attention_norm_weight, p.attention_norm_bias, R, a.attention_out.data(), a.attention_stats.data());
  // Feed-forward: dense to F, GELU, dense to H, dropout, residual, LayerNorm.
  Act* act = a.ffn_act.data();  // [R, F] after GELU (the output dense's input)
  linear_gelu(a.attention_out.data(), p.intermediate_weight, p.intermediate_bias, R, H, F, a.ffn_gelu_saved.data(),
              act);
  Act* out_sum = a.output_sum.data();  // [R, H] attention_out + dropout(act Wf^T + bf)
  linear_dropout_residual(act, p.output_weight, p.output_bias, R, F, H, a.attention_out.data(), out_sum, step,
                          first_sample, dropout_key(l, dropout_ffn_output));
  layer_norm(out_sum, p.output_norm_weight, p.output_norm_bias, R, open(output), a.output_stats.data());
}

// The MLM head on the S selected rows only: the loss reads no other row, so
// computing the head there gives the same loss and gradients as Hugging
// Face's head over all rows with labels -100 elsewhere, at S/R of the cost.
// With `backward`, also the head's backward, ending with dL/d the last
// block's output in gradient_flow_ (zero on rows that were not selected).
// The per-row losses stay on the device in sample_loss_ (loss_contribution
// reads them). The head's buffers are temporaries, pushed here and popped
// before the blocks' backward starts.
template <class Act>
inline void Model<Act>::head_forward_backward(long step, float gradient_scale, bool backward) {
  const int H = shape_.hidden, V = vocab_size, R = shape_.micro_batch * shape_.seq, S = selected_count_;
  const int* selected = selected_.data();                  // [S] which of the R rows carry a label
  const int* targets = targets_.data();                    // [S] their labels (the original bytes)
  const Act* hidden = checkpoints_[shape_.layers].data();  // [R, H] the last block's output
  Act* gathered = open(head_input_);                       // [S, H] its selected rows
  Act* gelu_saved = open(head_gelu_saved_);                // [S, H] for GELU's backward (see linear_gelu)
  Act* act = open(head_act_);                              // [S, H] after GELU: the head LayerNorm's input
  float* stats = open(head_stats_);                        // [S, 2] fp32
  Act* out = open(head_out_);                              // [S, H] LayerNorm's output: the decoder's input
  Act* logits = open(logits_);                             // [S, V]
  compute_.for_each((size_t)S, (size_t)H,
                    Z2_LOOP2(s, j, { gathered[s * H + j] = hidden[(size_t)selected[s] * H + j]; }));
  linear_gelu(gathered, ids_.head_dense_weight, ids_.head_dense_bias, S, H, H, gelu_saved, act);
  layer_norm(act, ids_.head_norm_weight, ids_.head_norm_bias, S, out, stats);
  // logits [S, V] = out x word_embeddings^T + decoder bias (the tied decoder).
  matmul_bias(out, param(ids_.word_embeddings), param(ids_.decoder_bias), S, H, V, logits);
  // Loss per row (fp32); logits are overwritten by their gradient, already
  // divided by the global count (so the reduced sum over ranks is the mean's
  // gradient) and, in fp16, multiplied by the loss scale.
  float* sample_loss = sample_loss_.data();
  compute_.for_each((size_t)S, Z2_LOOP(s, {
                      Act* row = logits + s * V;
                      sample_loss[s] = cross_entropy_row(row, V, targets[s], gradient_scale, row);
                    }));
  if (backward) {
    const Act* dlogits = logits;  // [S, V] dL/dlogits, in the logits' buffer
    column_sums(dlogits, S, V, gradient(ids_.decoder_bias));
    engine_.gradient_ready(ids_.decoder_bias);
    // The tied decoder's gradient [V, H] = dlogits^T x out. It belongs to the
    // word embeddings, whose bucket is the very first (written last), so we
    // keep it here until the embeddings' backward adds its own part: handing it
    // over now would hold a stage-2 staging slot open through all of backward.
    compute_.gemm(true, false, V, H, S, 1.0f, dlogits, V, out, H, 0.0f, open(decoder_gradient_), H);
    Act* dhidden = open(gradient_flow_);  // [R, H] dL/d the last block's output
    Act* dout = open(head_dout_);         // [S, H] dL/d head LayerNorm output = dlogits x word_embeddings
    compute_.gemm(false, false, S, H, V, 1.0f, dlogits, V, param(ids_.word_embeddings), H, 0.0f, dout, H);
    Act* dact = open(head_dact_);  // [S, H] dL/d GELU output, then (in place) dL/d its input
    layer_norm_backward(act, stats, dout, ids_.head_norm_weight, ids_.head_norm_bias, S, dact);
    gelu_backward(gelu_saved, (size_t)S * H, dact);
    Act* dgathered = open(head_dgathered_);  // [S, H] dL/d the selected rows
    linear_backward(gathered, dact, ids_.head_dense_weight, ids_.head_dense_bias, S, H, H, dgathered, 0.0f);
    // Scatter back to the selected rows; the others get zero.
    compute_.fill_zero(dhidden, (size_t)R * H * sizeof(Act), compute_.compute_stream());
    compute_.for_each((size_t)S, (size_t)H,
                      Z2_LOOP2(s, j, { dhidden[(size_t)selected[s] * H + j] = dgathered[s * H + j]; }));
    close(head_dgathered_), close(head_dact_), close(head_dout_);
  }
  close(logits_), close(head_out_), close(head_stats_), close(head_act_), close(head_gelu_saved_), close(head_input_);
}

// The micro-batch's loss contribution: sum over its S selected rows of
// loss / count, in the canonical tree, on the host. run() calls it only after
// backward has been queued, so the GPU does not sit idle in the middle of a
// micro-step while the host waits for the losses.
template <class Act>
inline float Model<Act>::loss_contribution(float loss_scale) {
  const int S = selected_count_;
  std::vector<float> losses(S);
  compute_.copy(losses.data(), sample_loss_.data(), (size_t)S * sizeof(float), compute_.compute_stream());
  compute_.synchronize(compute_.compute_stream());
  return z2::canonical_tree_sum(S, [&](long s) { return losses[s] * loss_scale; });
}

// --- backward ----------------------------------------------------------------

// Backward of block l: dL/d output in gradient_flow_ in, dL/d input in
// gradient_flow_ out. The block's activations are open (kept, or just
// recomputed); its scratch is pushed here and popped in reverse. (Over 80
// lines on purpose: it is block_forward's operations undone in reverse order,
// and the pushes and pops of its scratch must pair up LIFO within one body.)
template <class Act>
inline void Model<Act>::block_backward(int l, long step, long first_sample) {
  const int B = shape_.micro_batch, T = shape_.seq, H = shape_.hidden, NH = shape_.heads, D = shape_.head_dim(),
            F = shape_.intermediate, R = B * T;
  const BlockParameters& p = ids_.blocks[l];
  BlockActivations<Act>& a = block(l);
  const Act* x = checkpoints_[l].data();  // [R, H] the block's input
  // The flow buffer and three scratch buffers, reused as backward goes up the
  // block (the names say what each holds first; later reuses are named where
  // they happen):
  Act* dy = gradient_flow_.data();  // [R, H] dL/d block output in; dL/d block input out
  Act* dsum = open(dsum_);          // [R, H] dL/d output_sum, then dL/d attention_out
  Act* wide_scratch =
      open(wide_scratch_);         // [R, F] dL/d ffn_act, then dL/d the FFN's pre-activation; later dq, dk [R, H] each
  Act* dattn = open(dattention_);  // [R, H] dL/d attention_sum (the residual into x)

  // Output LayerNorm: dsum = dL/d(attention_out + dropout(ffn)).
  layer_norm_backward(a.output_sum.data(), a.output_stats.data(), dy, p.output_norm_weight, p.output_norm_bias, R,
                      dsum);
  // The FFN branch sees dsum through the dropout; the residual gets dsum itself.
  Act* dffn = dy;  // dy is no longer needed: reuse it
  dropout(dsum, dffn, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(l, dropout_ffn_output));
  linear_backward(a.ffn_act.data(), dffn, p.output_weight, p.output_bias, R, F, H, wide_scratch, 0.0f);
  gelu_backward(a.ffn_gelu_saved.data(), (size_t)R * F, wide_scratch);
  // d attention_out = dsum (residual) + wide_scratch x Wi: gemm with beta = 1 adds onto dsum.
  linear_backward(a.attention_out.data(), wide_scratch, p.intermediate_weight, p.intermediate_bias, R, H, F, dsum,
                  1.0f);
  // Attention LayerNorm: dattn = dL/d(x + dropout(dense(context))).
  layer_norm_backward(a.attention_sum.data(), a.attention_stats.data(), dsum, p.attention_norm_weight,
                      p.attention_norm_bias, R, dattn);
  Act* ddense = dsum;  // [R, H] dL/d the attention output dense's result: dattn through the dropout
  dropout(dattn, ddense, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(l, dropout_attention_output));
  Act* dcontext = dy;  // [R, H] dL/d context, heads side by side
  linear_backward(a.context.data(), ddense, p.attention_output_weight, p.attention_output_bias, R, H, H, dcontext,
                  0.0f);

  // Attention, per (sample, head): with P the probabilities and Pd = dropout(P),
  // dV = Pd^T dC, dPd = dC V^T, dP = dropout(dPd), dS = P (dP - rowsum(dP P)) / sqrt(D),
  // dQ = dS K, dK = dS^T Q. dq and dk go to wide_scratch (R x max(2H, F)), dv to
  // dsum (free once the attention output's backward is done).
  const size_t scores_per_head = (size_t)T * T;
  const Act* probs = a.probs.data();  // [B, NH, T, T] saved softmax output
  const float rate = shape_.dropout;
  Act* dropped = rate > 0.0f ? open(dropped_) : nullptr;  // [B, NH, T, T] probs after dropout, recomputed from its keys
  Act *dq = wide_scratch, *dk = wide_scratch + (size_t)R * H, *dv = dsum;  // dsum is free again
  Act* dprobs = open(dprobs_);  // [B, NH, T, T] dL/d dropped probs, then d scores
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, true, T, T, D, 1.0f, dcontext + rows, H, D, a.value.data() + rows, H, D, 0.0f,
                          dprobs + square, T, (long)scores_per_head, NH);
  }
  // One pass over each row: the dropped probabilities (for dV), dP =
  // dropout(dPd) with the same mask, and softmax's backward.
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, dropout_key(l, dropout_attention_probs), step);
  const size_t rows_per_sample = (size_t)NH * T;
  const float inverse_sqrt = 1.0f / sqrtf((float)D);
  compute_.for_each((size_t)B * NH * T, Z2_LOOP(row, {
                      const Act* p_row = probs + row * T;
                      Act* d_row = dprobs + row * T;
                      if (dropped) {
                        const uint64_t row_key =
                            dropout_row_key(tensor_key, first_sample + (long)(row / rows_per_sample));
                        const size_t first_element = (row % rows_per_sample) * T;
                        dropout_row(rate, row_key, first_element, p_row, dropped + row * T, T);
                        dropout_row(rate, row_key, first_element, d_row, d_row, T);
                      }
                      softmax_backward_row(p_row, d_row, T, inverse_sqrt);
                    }));
  const Act* source = dropped ? dropped : probs;  // what multiplied V in forward
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(true, false, T, D, T, 1.0f, source + square, T, (long)scores_per_head, dcontext + rows, H, D,
                          0.0f, dv + rows, H, D, NH);
  }
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, false, T, D, T, 1.0f, dprobs + square, T, (long)scores_per_head, a.key.data() + rows,
                          H, D, 0.0f, dq + rows, H, D, NH);
    compute_.gemm_batched(true, false, T, D, T, 1.0f, dprobs + square, T, (long)scores_per_head, a.query.data() + rows,
                          H, D, 0.0f, dk + rows, H, D, NH);
  }
  close(dprobs_);
  if (dropped) close(dropped_);
  // dx = dattn (residual) + dv Wv + dk Wk + dq Wq, added in that order into
  // dy: value first, so gradients reach the engine in exactly the reverse of
  // registration order and stage 2 never needs more than its two slots.
  Act* dx = dy;
  compute_.copy(dx, dattn, (size_t)R * H * sizeof(Act), compute_.compute_stream());
  close(dattention_);
  linear_backward(x, dv, p.value_weight, p.value_bias, R, H, H, dx, 1.0f);
  linear_backward(x, dk, p.key_weight, p.key_bias, R, H, H, dx, 1.0f);
  linear_backward(x, dq, p.query_weight, p.query_bias, R, H, H, dx, 1.0f);
  close(wide_scratch_), close(dsum_);
}

// Embeddings' backward, last: dL/d x0 in gradient_flow_, the embedding sum
// and stats open (kept, or just recomputed).
template <class Act>
inline void Model<Act>::embeddings_backward(long step, long first_sample) {
  const int H = shape_.hidden, T = shape_.seq, B = shape_.micro_batch, R = B * T, P = shape_.max_positions;
  Act* dx0 = gradient_flow_.data();  // [R, H] dL/d x0 (from block 0's backward)
  dropout(dx0, dx0, (size_t)R * H, (size_t)T * H, step, first_sample,
          dropout_key(embeddings_layer, dropout_embeddings));
  Act* dsum = open(dsum_);  // [R, H] dL/d (word + position + type)
  layer_norm_backward(embedding_sum_.data(), embedding_stats_.data(), dx0, ids_.embedding_norm_weight,
                      ids_.embedding_norm_bias, R, dsum);
  // Token type 0 is at every position: the column sums.
  column_sums(dsum, R, H, gradient(ids_.token_type_embeddings));
  engine_.gradient_ready(ids_.token_type_embeddings);
  // Position t collects row t of every sample, samples in order; unused positions get 0.
  Act* dposition = gradient(ids_.position_embeddings);  // [P, H]
  compute_.for_each((size_t)P, (size_t)H, Z2_LOOP2(t, j, {
                      float sum = 0.0f;
                      if (t < (size_t)T)
                        for (int b = 0; b < B; ++b) sum += to_float(dsum[((size_t)b * T + t) * H + j]);
                      dposition[t * H + j] = from_float<Act>(sum);
                    }));
  engine_.gradient_ready(ids_.position_embeddings);
  // Word row v: the tied decoder's part plus the rows where token v occurs,
  // in position order (the counting sort made on the host).
  Act* dword = gradient(ids_.word_embeddings);    // [V, H]
  const Act* decoder = decoder_gradient_.data();  // [V, H] the tied decoder's part
  const int* offsets = token_offsets_.data();     // [V + 1] CSR offsets by token id
  const int* rows = token_rows_.data();           // [R] positions sorted by token id, in order within an id
  compute_.for_each((size_t)vocab_size, (size_t)H, Z2_LOOP2(v, j, {
                      float sum = 0.0f;
                      for (int k = offsets[v]; k < offsets[v + 1]; ++k) sum += to_float(dsum[(size_t)rows[k] * H + j]);
                      dword[v * H + j] = from_float<Act>(to_float(decoder[v * H + j]) + sum);
                    }));
  engine_.gradient_ready(ids_.word_embeddings);
  close(dsum_);
}

// One micro-step. The order of open and close below is the order a framework
// would allocate and free these tensors in; the arena and naive allocators
// serve the same requests (notes/05).
template <class Act>
inline float Model<Act>::run(const Batch& batch, long step, long micro_batch, float loss_scale, bool backward) {
  const long first_sample = micro_batch * shape_.micro_batch;
  const int L = shape_.layers;
  const bool keep = mode_ == ActivationMode::keep, offloading = mode_ == ActivationMode::offload;
  if (timing_) compute_.synchronize_all(), phase_start_ = std::chrono::steady_clock::now();
  upload(batch);
  // Forward. With keep, every block's buffers stay open until its backward;
  // otherwise one working set is pushed and popped per block and only the
  // checkpoints stay.
  open(embedding_sum_), open(embedding_stats_);
  embeddings_forward(step, first_sample, open(checkpoints_[0]));
  if (!keep) close(embedding_stats_), close(embedding_sum_);
  if (offloading && 0 <= L - 2) offload(0);
  for (int l = 0; l < L; ++l) {
    open_block(block(l));
    block_forward(l, step, first_sample, checkpoints_[l + 1]);
    if (!keep) close_block(block(l));
    if (offloading && l + 1 <= L - 2) offload(l + 1);
    if (offloading && l <= L - 2) {
      // Checkpoint l has been read and copied out: its slot may be reused
      // once the copy is done (the compute stream waits for it, not the host).
      compute_.wait(compute_.compute_stream(), offloaded_[l]);
      close(checkpoints_[l]);
    }
  }
  end_phase(&Times::forward_ms);
  // fp16: the gradient carries the engine's loss scale (a power of two, so
  // the product with 1/count is exact); 1 in fp32 and bf16.
  head_forward_backward(step, loss_scale * engine_.loss_scale(), backward);
  close(checkpoints_[L]);
  if (!backward) {
    // Loss only (the tests' finite differences): give back what forward kept.
    for (int l = L - 1; l >= 0; --l) {
      if (keep) close_block(block(l));
      close(checkpoints_[l]);
    }
    close(embedding_stats_), close(embedding_sum_);
    return loss_contribution(loss_scale);
  }

  // Backward, last block first. Checkpoint l - 1 comes back from the host
  // while block l works (offload), so it is there when block l - 1 starts.
  for (int l = L - 1; l >= 0; --l) {
    const int fetch = offloading ? z2::checkpoint_to_prefetch(l, L) : -1;
    if (fetch >= 0) prefetch(fetch);
    if (offloading && l <= L - 2) {
      // Reading a checkpoint still on the host would read whatever its slot holds now.
      if (!fetched_[l])
        z2::usage_error(
            "offload: block %d's backward needs checkpoint %d, which was never brought back from the host "
            "(checkpoint_to_prefetch returned it for no block before this one)",
            l, l);
      compute_.wait(compute_.compute_stream(), prefetched_[l]);
    }
    if (!keep) {
      // Recompute the block's forward from its checkpoint: the same code,
      // inputs and dropout keys, so the same bits as the first time.
      open_block(block(l));
      block_forward(l, step, first_sample, recomputed_output_);
      close(recomputed_output_);
    }
    block_backward(l, step, first_sample);
    close_block(block(l));
    close(checkpoints_[l]);
    engine_.progress();  // let MPI move the buckets already handed over
  }
  if (!keep) {
    // The embeddings' sum and stats, recomputed (their output is not needed).
    open(embedding_sum_), open(embedding_stats_);
    embeddings_forward(step, first_sample, open(recomputed_output_));
    close(recomputed_output_);
  }
  embeddings_backward(step, first_sample);
  close(embedding_stats_), close(embedding_sum_);
  close(gradient_flow_), close(decoder_gradient_);
  const float contribution = loss_contribution(loss_scale);
  engine_.end_micro_step(contribution);
  end_phase(&Times::backward_ms);
  return contribution;
}

// ----------------------------------------------------------------------------
// Training

// --- interrupts ---------------------------------------------------------------
//
// The first SIGINT or SIGTERM asks the run to stop after the current step:
// every rank agrees at the end of each step, saves a checkpoint (--save),
// writes --json marked interrupted and exits 128 + the signal (130, 143). A
// second one at least 2 s later ends the process at once (mpirun and a
// terminal may each deliver the first Ctrl-C, a moment apart).

inline volatile std::sig_atomic_t interrupt_signal = 0;
inline volatile std::sig_atomic_t interrupt_second = 0;  // CLOCK_MONOTONIC seconds of the first, + 2

inline void on_interrupt(int signal) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (interrupt_signal != 0 && now.tv_sec >= interrupt_second) {
    std::signal(signal, SIG_DFL);  // async-signal-safe, as is raise
    raise(signal);
    return;
  }
  if (interrupt_signal == 0) {
    interrupt_signal = signal;
    interrupt_second = (std::sig_atomic_t)(now.tv_sec + 2);
  }
}

inline void catch_interrupts() {
  interrupt_signal = 0;
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
}

// --- before step 1 -------------------------------------------------------------

// Checks that touch this host's files: every rank reads its own copy of the
// data (and of --init-hf's weights), rank 0 alone writes. On several hosts
// one of them may lack a file, so the ranks agree on the outcome before
// anyone enters a collective.
inline std::string read_inputs(const Settings& settings, int rank, MPI_Comm world, InitialWeights& initial) {
  std::string corpus;
  agree_on_errors(world, [&] {
    if (rank == 0) check_outputs(settings);
    corpus = read_corpus(settings.data);
    if (corpus.size() < (size_t)settings.seq - 2)
      fail("the corpus has %zu bytes; --seq %d needs at least %d (a window is seq - 2 bytes)", corpus.size(),
           settings.seq, settings.seq - 2);
    if (settings.checkpoint) check_checkpoint_data(settings, corpus);  // the data it was trained on, byte for byte
    if (!settings.init_hf.empty()) initial = read_initial_weights(settings.init_hf, shape_of(settings));
  });
  return corpus;
}

// With --eval-every, the last 5% of the data (at least one window) is held
// out: training draws its windows from the rest (the same bytes on every
// rank, so every rank splits at the same place, or refuses the same way).
inline void split_held_out(const Settings& settings, const std::string& corpus, std::string& training_text,
                           std::string& held_out) {
  training_text = corpus;
  if (settings.eval_every > 0) {
    const size_t window = (size_t)settings.seq - 2, held = std::max(window, corpus.size() / 20);
    if (corpus.size() < held + window)
      fail(
          "--eval-every holds out the data's last %s bytes (5%%, at least one window of --seq - 2), leaving %s "
          "bytes to train on; a window needs %zu: give more data or a shorter --seq",
          z2::with_commas(held).c_str(), z2::with_commas(corpus.size() - std::min(held, corpus.size())).c_str(),
          window);
    held_out = corpus.substr(corpus.size() - held);
    training_text.resize(corpus.size() - held);
  }
}

// --- the run --------------------------------------------------------------------

// The whole run on this rank, with activations (and the engine's working
// parameters and gradients) of type Act: construction does everything up
// to step 1 (inputs, the fit check, the engine, the model, a checkpoint
// loaded), run() the steps and the outputs. What the reports say is kept in
// run_ (trainer/reports.h), which they read without the model.
template <class Act>
class Training {
 public:
  Training(Settings settings, MPI_Comm world);
  int run();  // the process exit code

 private:
  void train_step(long step);
  float evaluate() const;
  void log_evaluation(long step);

  Settings settings_;
  MPI_Comm world_;
  int rank_ = 0, world_size_ = 1;
  std::string corpus_;
  std::unique_ptr<z2::Compute> compute_;
  std::unique_ptr<z2::Communicator> comm_;
  std::unique_ptr<z2::Engine> engine_;
  std::unique_ptr<Model<Act>> model_;
  RunRecord run_;         // the device, the shape, the steps, evaluations and saves, for the reports
  ProgressLog progress_;  // the progress lines and --metrics
  std::unique_ptr<DirectoryLock> save_lock_;   // rank 0 with --save: held until the run ends
  InitialWeights initial_weights_;             // --init-hf's, until the engine holds them
  std::unique_ptr<DirectoryLock> trace_lock_;  // rank 0 with --trace: claimed before the engine, then the trace's
  std::unique_ptr<RunTrace> trace_;            // rank 0 with --trace
  // What watches each step: its time, the memory trace, the dump, the trace, the progress line.
  std::unique_ptr<StepObservers> observers_;
  // --eval-every: the held-out tail of the data, and what training draws from.
  std::string training_text_, held_out_;
};

template <class Act>
Training<Act>::Training(Settings settings, MPI_Comm world)
    : settings_(std::move(settings)), world_(world), progress_(settings_, world) {
  MPI_Comm_rank(world_, &rank_);
  MPI_Comm_size(world_, &world_size_);
  z2::set_watchdog_timeout(settings_.timeout);  // from here every wait has a deadline
  check_consistency(settings_, world_size_);
  corpus_ = read_inputs(settings_, rank_, world_, initial_weights_);
  split_held_out(settings_, corpus_, training_text_, held_out_);
  run_.corpus_bytes = corpus_.size();
  run_.held_out_bytes = held_out_.size();
  run_.initial_weights_unused = initial_weights_.notes;
  // Every rank finds the same difference: the same message and exit everywhere.
  if (world_size_ > 1)
    check_same_inputs(settings_, corpus_, loaded_index_text(settings_), initial_weights_.fingerprint, world_);
  // Rank 0 saves: it locks --save and looks at what it holds, before step 1.
  if (!settings_.save_dir.empty())
    agree_on_errors(
        world_,
        [&] {
          if (rank_ == 0) save_lock_ = claim_save_directory(settings_);
        },
        "the --save directory was claimed");
  if (!settings_.trace_dir.empty())  // before the engine: a second run into one --trace stops here
    agree_on_errors(
        world_,
        [&] {
          if (rank_ == 0) trace_lock_ = claim_trace_directory(settings_);
        },
        "the --trace directory was claimed");
  run_.world_size = world_size_;
  run_.device = z2::choose_device(settings_.device, world_);
  run_.comm = z2::choose_comm(settings_.comm, run_.device, world_);
  run_.precision = z2::precision_of<Act>();
  run_.shape = shape_of(settings_);
  compute_ = std::make_unique<z2::Compute>(run_.device, z2::local_rank_of(world_));  // selects this rank's GPU
  // The model writes every element of a pushed activation before reading it
  // (the suite checks with --poison-activations), so zeroing them was one
  // more pass over every activation buffer, every step.
  compute_->set_activation_fill(settings_.poison_activations ? z2::Compute::PushFill::poison
                                                             : z2::Compute::PushFill::none);
  compute_->set_portable(settings_.portable);
  run_.mode = mode_of(settings_);
  run_.allocator = allocator_of(settings_);
  if (run_.allocator == z2::Allocator::direct && run_.device != z2::Device::cuda)
    fail(
        "--alloc cuda is cudaMalloc and cudaFree for every tensor: it needs a GPU (--device cuda); on the cpu "
        "use --alloc caching, the model of PyTorch's caching allocator");
  const size_t capacity = memory_block(settings_, run_.allocator, run_.device, world_size_, world_);
  // Reserving can fail on one rank only (ranks sharing a GPU measured its
  // free memory at slightly different times), so the ranks agree.
  agree_on_errors(
      world_, [&] { compute_->use_allocator(run_.allocator, capacity); }, "every rank has its memory");
  run_.memory_block = compute_->capacity();
  comm_ = std::make_unique<z2::Communicator>(
      *compute_, world_, run_.comm,
      settings_.collectives == "native" ? z2::Collectives::native : z2::Collectives::deterministic);
  engine_ = std::make_unique<z2::Engine>(*compute_, *comm_, engine_options(settings_, run_.precision));
  model_ = std::make_unique<Model<Act>>(*compute_, *engine_, run_.shape, run_.mode);
  model_->time_phases(settings_.wall_clock_breakdown);
  engine_->build();
  model_->initialize();
  if (!settings_.init_hf.empty()) {  // where another implementation's run started (notes/12)
    engine_->parameters_from_host(initial_weights_.values);
    initial_weights_ = InitialWeights();
  }
  if (settings_.checkpoint) run_.loaded = load_checkpoint(settings_, *engine_, model_->tensor_shapes(), world_);
  if (!settings_.trace_dir.empty()) {
    const std::vector<float> initial = engine_->parameters_to_host();  // collective (a sharded master)
    agree_on_errors(
        world_,
        [&] {
          if (rank_ != 0) return;
          trace_ = std::make_unique<RunTrace>(settings_, std::move(trace_lock_));
          trace_->write_initial(run_.shape, model_->tensor_shapes(), *engine_, initial);
        },
        "the trace's initial weights were written");
  }
  run_.tokens_per_step = (long)world_size_ * settings_.accum * settings_.micro_batch * settings_.seq;
  run_.start_ledger = engine_->memory_ledger();
  // What the observers read of the model: its shapes, its phases' times, and
  // the micro-batches the data draws (the dump's and the trace's).
  ObservedModel observed{
      model_->tensor_shapes(),
      [this] {
        const typename Model<Act>::Times times = model_->take_times();
        return std::pair(times.forward_ms, times.backward_ms);
      },
      [this](long step, long m) {
        Batch batch = make_batch(training_text_, settings_.seed, step, m, settings_.micro_batch, settings_.seq);
        return DrawnBatch{std::move(batch.tokens), std::move(batch.labels), (long)batch.selected.size()};
      }};
  observers_ = std::make_unique<StepObservers>(settings_, world_, *compute_, *engine_, std::move(observed), run_,
                                               progress_, trace_.get());
}

// One optimizer step: A micro-steps of forward and backward on this rank's
// micro-batches, then the engine's step (the gradient reduced, clipped and
// applied, the working parameters gathered). What watches it (its time,
// --memory-trace, --dump-batch, --trace, the progress line) is
// trainer/step_observers.h's, at the three points where it reads something.
template <class Act>
void Training<Act>::train_step(long step) {
  observers_->before_forward(step);
  const int A = settings_.accum, B = settings_.micro_batch, T = settings_.seq;
  const long selected = global_selected_count(training_text_, settings_.seed, step, (long)world_size_ * A, B, T);
  // A global batch with no selected position has no loss; the scale 1/1 then
  // multiplies nothing (every gradient is zero).
  const float loss_scale = 1.0f / (float)std::max(1l, selected);
  std::vector<float> losses;  // this rank's micro-batches' shares of the step's loss, in order
  for (int a = 0; a < A; ++a) {
    const long m = engine_->micro_batch_index(a);
    losses.push_back(model_->run(make_batch(training_text_, settings_.seed, step, m, B, T), step, m, loss_scale, true));
  }
  observers_->before_update(step);
  const z2::StepReport report = engine_->step();
  compute_->synchronize_all();
  observers_->after_update(step, report, losses);
  if (diverged(report)) fail("the loss is %g at step %ld: training diverged (lower --lr?)", report.loss, report.step);
}

// The MLM loss on --eval-batches micro-batches of held-out windows, without
// dropout: the mean over all their selected positions, summed micro-batch by
// micro-batch in order. The windows and masks are keyed by a step number no
// training step has (-1), so every evaluation reads the same batch. Every
// rank computes it whole from the full working weights (every stage holds
// them), so the value does not depend on N or the stage.
template <class Act>
float Training<Act>::evaluate() const {
  const int B = settings_.micro_batch, T = settings_.seq, E = settings_.eval_batches;
  const long key = -1;
  const long selected = global_selected_count(held_out_, settings_.seed, key, E, B, T);
  const float loss_scale = 1.0f / (float)std::max(1l, selected);
  model_->set_evaluation(true);
  float loss = 0.0f;
  for (int m = 0; m < E; ++m)
    loss += model_->run(make_batch(held_out_, settings_.seed, key, m, B, T), key, m, loss_scale, false);
  model_->set_evaluation(false);
  return loss;
}

template <class Act>
void Training<Act>::log_evaluation(long step) {
  const float loss = evaluate();
  run_.evaluations.push_back({step, loss});
  progress_.evaluation(step, loss);
}

template <class Act>
int Training<Act>::run() {
  if (progress_.prints()) print_header(settings_, run_, *engine_);
  progress_.start(engine_->training_progress().steps_taken);
  catch_interrupts();
  const long first_step = engine_->training_progress().steps_taken;
  const long last_step = settings_.export_only ? first_step : settings_.steps;
  auto save = [&] {
    run_.saved.push_back(save_checkpoint(settings_, *engine_, model_->tensor_shapes(), corpus_, world_));
  };
  for (long step = first_step; step < last_step; ++step) {
    train_step(step);
    // A signal on any rank stops every rank after the same step.
    int mine = (int)interrupt_signal, signal = 0;
    z2::watched_allreduce(&mine, &signal, 1, MPI_INT, MPI_MAX, world_, "the ranks agreeing whether to stop (a signal)");
    const long done = step + 1;
    if (settings_.eval_every > 0 && (done % settings_.eval_every == 0 || done == last_step)) log_evaluation(done);
    if (!settings_.save_dir.empty() && settings_.save_every > 0 && done % settings_.save_every == 0) save();
    if (signal != 0) {
      run_.interrupted_by = signal;
      break;
    }
  }
  // At the end (or the interrupt), unless that step was just saved. A run
  // that trained nothing saves too: --load at one N, --save at another
  // re-slices a checkpoint without a step.
  const long now = engine_->training_progress().steps_taken;
  if (!settings_.save_dir.empty() && (run_.saved.empty() || run_.saved.back().step != now)) save();
  z2::set_watchdog_context("the end of the run, after step " +
                           std::to_string(engine_->training_progress().steps_taken));
  // The fp32 master weights (collective: sharded in mixed precision stages 1, 2).
  const std::vector<float> final_parameters = engine_->parameters_to_host();
  char hash[24];
  snprintf(hash, sizeof hash, "%016llx",
           (unsigned long long)z2::fnv1a64(final_parameters.data(), final_parameters.size()));
  // The export is the trained model: an interrupted run has a checkpoint instead (--save).
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0 && !settings_.export_dir.empty() && run_.interrupted_by == 0)
          export_hf(settings_.export_dir, run_.shape, model_->tensor_shapes(), *engine_, final_parameters);
      },
      "the export was written");
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0 && trace_) trace_->finish(run_.shape, model_->tensor_shapes(), *engine_, run_.interrupted_by);
      },
      "the trace was written");
  if (progress_.prints()) print_summary(settings_, run_, *engine_, hash);
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0 && !settings_.json_path.empty()) write_json(settings_, run_, *engine_, hash);
      },
      "the JSON summary was written");
  observers_->write_timeline();
  // Every rank reaches here before any finalizes: a rank stopped now would
  // otherwise leave the others in MPI_Finalize, where no watchdog runs.
  MPI_Request finished;
  Z2_MPI_CHECK(MPI_Ibarrier(world_, &finished));
  z2::wait_request(&finished, "the end of the run (every rank finishing)");
  return run_.interrupted_by != 0 ? 128 + run_.interrupted_by : 0;
}

// The run in the precision the settings name: the model, its activations and
// the engine's working copy in float, bfloat16 or float16 (or the memory plan,
// which needs no model: trainer/plan.cpp).
inline int train(Settings settings, MPI_Comm world) {
  if (settings.plan) return run_plan(settings, world);
  switch (precision_of(settings)) {
    case z2::Precision::bf16: return Training<z2::bfloat16>(settings, world).run();
    case z2::Precision::fp16: return Training<z2::float16>(settings, world).run();
    default: return Training<float>(settings, world).run();
  }
}

}  // namespace bert

#ifndef BERT_NO_MAIN
// Every rank runs the same code on the same arguments, so a bad setting
// throws on every rank at the same point; rank 0 prints the one message, all
// ranks finalize MPI and exit 2. Failures inside a library call (CUDA, NCCL,
// MPI) abort every rank from the check macros instead.
int main(int argc, char** argv) {
  // FUNNELED: ZeRO-Offload's host step runs OpenMP threads (--host-threads),
  // and only this, the main thread, calls MPI.
  int threading = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &threading);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    bool help = false;
    for (int i = 1; i < argc; ++i) help = help || std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h";
    if (help) {
      if (rank == 0) fputs(bert::usage_text, stdout);
    } else {
      // Every rank reads its own --config (on several hosts, its own copy):
      // a failure on any rank is agreed on, so no rank waits for one that left.
      bert::Settings settings;
      const bert::LaunchFacts launch = bert::launch_facts(MPI_COMM_WORLD);  // collective: before any can fail
      bert::agree_on_errors(
          MPI_COMM_WORLD,
          [&] {
            bert::check_launch(launch);  // torchrun's or srun's processes are not MPI's ranks
            settings = bert::parse_command_line(argc, argv);
            bert::check_local_rank(settings, launch);
            int world_size = 1;
            MPI_Comm_size(MPI_COMM_WORLD, &world_size);
            if (!settings.load_dir.empty())
              bert::adopt_checkpoint(settings, world_size);  // before the precision is chosen
          },
          "the command line was read");
      status = bert::train(settings, MPI_COMM_WORLD);
    }
  } catch (const z2::Error& error) {
    if (rank == 0) fprintf(stderr, "train_bert_mini: error: %s\n", error.what());
    status = 2;
  } catch (const std::exception& error) {
    if (rank == 0) fprintf(stderr, "train_bert_mini: error: %s\n", error.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
#endif
