// tests/test_bert.cu — tests of the BERT-mini trainer that need its insides:
// it #includes train_bert_mini.cu (main compiled out), as llm.c's test_gpt2
// includes train_gpt2, so the code under test is exactly the code that trains.
// Compiled by nvcc in the default build (the model's kernels need it) and by
// mpicxx as C++ in `make cpu`.
//
// What is here: the finite-difference gradient check of every parameter
// tensor, the data pipeline's determinism and masking rates, the config file
// (DeepSpeed keys, overrides, unknown keys), the learning-rate schedule, and
// ZeRO-R: every --activations x --alloc through bert::train in every stage
// (same bits, ledger peak = formula), offload's measured bound, and the
// arena's stack order on loss-only and full micro-steps.
// The stage matrix, the bad-input list and the PyTorch reference run through
// the real command line in tests/cli/ (stages.sh, zero_r.sh).
#define BERT_NO_MAIN
#include "../train_bert_mini.cu"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>  // the runs' --json summaries (the model's file includes no JSON)

#include "harness.h"

namespace {

// A model small enough to differentiate numerically in a second, with every
// feature switched on: 2 blocks, 2 heads, dropout (its masks are fixed by
// their keys, so the loss is a fixed, differentiable function of the weights).
bert::Settings tiny_settings() {
  bert::Settings s;
  s.layers = 2, s.hidden = 8, s.heads = 2, s.intermediate = 16, s.seq = 10, s.max_positions = 12;
  s.micro_batch = 4, s.dropout = 0.1f, s.seed = 11;
  return s;
}

}  // namespace

TEST_CASE("BERT finite differences: every element of every parameter tensor matches the loss's slope") {
  // One rank computes (the check needs no communication); the others wait.
  bool all_ok = true;
  for (const auto& backend : harness::sub_world(1)) {
    if (!backend.deterministic) continue;
    z2::Compute& compute = *backend.compute;
    bert::Settings settings = tiny_settings();
    z2::EngineOptions options;
    options.stage = 0, options.bucket_elements = 4096, options.overlap = false;
    z2::Engine engine(compute, *backend.deterministic, options);
    bert::Model<float> model(compute, engine, bert::shape_of(settings));
    engine.build();
    // Weights of order one (not the 0.02 init), so every path through the
    // network carries a gradient well above float noise; LayerNorm gains near 1.
    std::vector<float> theta(engine.psi());
    {
      size_t position = 0;
      for (size_t id = 0; id < engine.parameters().size(); ++id) {
        const bool gain = engine.parameters()[id].name.find("LayerNorm.weight") != std::string::npos;
        for (size_t i = 0; i < engine.parameters()[id].numel; ++i, ++position) {
          float u = 2.0f * z2::uniform_from_hash(z2::hash_keys(99, id, i)) - 1.0f;
          theta[position] = gain ? 1.0f + 0.3f * u : 0.5f * u;
        }
      }
    }
    engine.parameters_from_host(theta);
    const std::string corpus = bert::default_corpus();
    const long step = 3, micro_batch = 0;
    bert::Batch batch = bert::make_batch(corpus, settings.seed, step, micro_batch, settings.micro_batch, settings.seq);
    REQUIRE(batch.selected.size() > 0);
    const float scale = 1.0f / (float)batch.selected.size();
    auto loss_at = [&](const std::vector<float>& values) {
      engine.parameters_from_host(values);
      return (double)model.run(batch, step, micro_batch, scale, false);
    };
    engine.parameters_from_host(theta);
    model.run(batch, step, micro_batch, scale, true);
    const std::vector<float> gradient = engine.gradients_to_host();

    // Every element of every tensor: the central difference
    // (L(theta + h e_i) - L(theta - h e_i)) / 2h against backward's g_i.
    // The tiny model makes this 2 x 3,748 forward passes, about a second.
    //
    // Tolerance: the loss is a float32 mean of ~10 cross-entropies of order
    // 3, so each evaluation carries a rounding error of a few ulp(3) ~ 1e-6;
    // the central difference with h = 3e-3 turns that into ~3e-4, and its
    // truncation error h^2 |L'''| / 6 stays below that where the curvature
    // is large: with h = 1e-2 one position-embedding element (under the
    // dropout masks of the 32-bit keying) missed by 1.1 x its allowance, and
    // 3e-3 cut its error five-fold (truncation, not backward). Per element we
    // allow 1e-3 + 2% of |g_i|; per tensor, the error vector's norm may be 1%
    // of the gradient's plus the same noise floor (1e-3 sqrt(n)). Measured
    // here, the worst element uses 23% of its allowance. A wrong backward (a
    // missing dropout mask, a transposed product, a term left out of one
    // embedding row) misses by a sizable part of the affected elements: the
    // FFN output's dropout left out of backward gives 137 x the allowance.
    const double h = 3e-3;
    size_t position = 0;
    int checked = 0;
    double worst = 0, worst_ratio = 0;  // largest error, largest error / allowed
    std::vector<float> probe = theta;
    for (size_t id = 0; id < engine.parameters().size(); ++id) {
      const auto& info = engine.parameters()[id];
      double error_squares = 0, gradient_squares = 0;
      int bad_elements = 0;
      for (size_t i = 0; i < info.numel; ++i) {
        const size_t k = position + i;
        probe[k] = (float)(theta[k] + h);
        const double up = loss_at(probe);
        probe[k] = (float)(theta[k] - h);
        const double down = loss_at(probe);
        probe[k] = theta[k];
        // The step actually taken in float, not h, divides the difference.
        const double slope = (up - down) / ((double)(float)(theta[k] + h) - (double)(float)(theta[k] - h));
        const double error = std::fabs(slope - gradient[k]);
        worst = std::max(worst, error);
        worst_ratio = std::max(worst_ratio, error / (1e-3 + 0.02 * std::fabs(gradient[k])));
        error_squares += error * error;
        gradient_squares += (double)gradient[k] * gradient[k];
        if (!(error <= 1e-3 + 0.02 * std::fabs(gradient[k]))) {
          if (bad_elements++ < 3)
            fprintf(stderr, "[test] %s %s[%zu]: finite difference %.6g, backward %.6g\n", backend.name.c_str(),
                    info.name.c_str(), i, slope, gradient[k]);
          all_ok = false;
        }
      }
      const double error_norm = std::sqrt(error_squares), gradient_norm = std::sqrt(gradient_squares);
      if (!(error_norm <= 0.01 * gradient_norm + 1e-3 * std::sqrt((double)info.numel))) {
        fprintf(stderr, "[test] %s %s: |finite difference - backward| = %.3g for |g| = %.3g\n", backend.name.c_str(),
                info.name.c_str(), error_norm, gradient_norm);
        all_ok = false;
      }
      ++checked;
      position += info.numel;
    }
    MESSAGE(backend.name << ": " << checked << " tensors, " << position
                         << " elements checked, worst |finite difference - backward| = " << worst
                         << ", worst error / allowed = " << worst_ratio);
    // The check must see real gradients: the embeddings, every block and the head.
    double total = 0;
    for (float g : gradient) total += (double)g * g;
    all_ok &= total > 1e-4;
  }
  CHECK(harness::agree(all_ok, "finite-difference check failed"));
}

TEST_CASE("BERT data: a micro-batch is a pure function of (seed, step, micro-batch); masking is 15% / 80-10-10") {
  const std::string corpus = bert::default_corpus();
  bert::Batch a = bert::make_batch(corpus, 5, 7, 3, 8, 64), b = bert::make_batch(corpus, 5, 7, 3, 8, 64);
  CHECK(a.tokens == b.tokens);
  CHECK(a.labels == b.labels);
  bert::Batch other = bert::make_batch(corpus, 5, 7, 4, 8, 64);
  CHECK(a.tokens != other.tokens);
  // Micro-batch m of size B holds samples m*B .. m*B+B-1: two micro-batches of
  // 4 are the halves of one of 8.
  bert::Batch whole = bert::make_batch(corpus, 5, 7, 1, 8, 64), low = bert::make_batch(corpus, 5, 7, 2, 4, 64);
  CHECK(std::equal(low.tokens.begin(), low.tokens.end(), whole.tokens.begin()));
  // Rates over many samples: 15% selected; of those 80% [MASK], 10% another byte, 10% unchanged.
  long positions = 0, selected = 0, masked = 0, kept = 0;
  for (long m = 0; m < 200; ++m) {
    bert::Batch batch = bert::make_batch(corpus, 1, 0, m, 8, 128);
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
      const int t = (int)(i % 128);
      if (t == 0) CHECK(batch.tokens[i] == bert::cls_token);
      if (t == 127) CHECK(batch.tokens[i] == bert::sep_token);
      if (t == 0 || t == 127) continue;
      ++positions;
      if (batch.labels[i] < 0) continue;
      ++selected;
      masked += batch.tokens[i] == bert::mask_token;
      kept += batch.tokens[i] == batch.labels[i];
    }
  }
  const double select_rate = (double)selected / positions, mask_rate = (double)masked / selected,
               keep_rate = (double)kept / selected;
  // 200 x 8 x 126 = 201,600 positions: the binomial standard deviations are
  // 0.0008 (selection) and about 0.002 (the splits); we allow five of them.
  CHECK(std::fabs(select_rate - 0.15) < 0.004);
  CHECK(std::fabs(mask_rate - 0.80) < 0.01);
  // A random byte equals the original 1/256 of the time, so "kept" is 10% + 10%/256.
  CHECK(std::fabs(keep_rate - (0.10 + 0.10 / 256)) < 0.01);
  // The CSR lists of the word-embedding gradient cover every position once, in order.
  bert::Batch batch = bert::make_batch(corpus, 1, 0, 0, 4, 32);
  CHECK(batch.token_offsets.back() == 4 * 32);
  for (int v = 0; v < bert::vocab_size; ++v)
    for (int k = batch.token_offsets[v]; k < batch.token_offsets[v + 1]; ++k) {
      CHECK(batch.tokens[batch.token_rows[k]] == v);
      if (k > batch.token_offsets[v]) CHECK(batch.token_rows[k] > batch.token_rows[k - 1]);
    }
}

TEST_CASE(
    "BERT config file: DeepSpeed keys map to flags, the command line overrides, left-out keys take DeepSpeed's "
    "defaults, unknown keys are warned about or named") {
  const std::string path = "/tmp/z2_test_config_" + std::to_string(harness::rank()) + ".json";
  // DeepSpeed refuses a file with neither train_batch_size nor
  // train_micro_batch_size_per_gpu (runtime/config.py:979-981), and so does
  // the trainer: a file here without one is given the trainer's 8 (and a
  // refusal of its own is checked below, where the key is left out on purpose).
  auto write = [&](std::string text) {
    const bool batch_key = text.find("\"train_batch_size\"") != std::string::npos ||
                           text.find("\"train_micro_batch_size_per_gpu\"") != std::string::npos;
    if (!batch_key && !text.empty() && text[0] == '{') text.insert(1, "\"train_micro_batch_size_per_gpu\": 8, ");
    std::ofstream(path) << text;
  };
  auto parse = [&](std::vector<std::string> arguments) {
    std::vector<char*> argv{(char*)"train_bert_mini"};
    for (auto& a : arguments) argv.push_back((char*)a.c_str());
    return bert::parse_command_line((int)argv.size(), argv.data());
  };
  write(R"({"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5000, "overlap_comm": false,
                                 "contiguous_gradients": true},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.0002, "betas": [0.8, 0.95], "eps": 1e-6,
                                                     "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50,
                                                            "warmup_max_lr": 0.0003, "warmup_type": "linear"}}})");
  bert::Settings s = parse({"--config", path});
  CHECK(s.micro_batch == 6);
  CHECK(s.accum == 3);
  CHECK(s.clip == 0.5);
  CHECK(s.stage == 1);
  CHECK(s.bucket == 5000);
  CHECK(!s.overlap);
  CHECK(s.beta1 == 0.8);
  CHECK(s.beta2 == 0.95);
  CHECK(s.eps == 1e-6);
  CHECK(s.weight_decay == 0.1);
  CHECK(s.warmup == 5);
  CHECK(s.schedule_steps == 50);  // the schedule's length; the run's follows from it in check_consistency
  CHECK(s.lr == 0.0003);          // the scheduler's peak, read after the optimizer's lr
  // Flags win over the file wherever they appear on the line.
  s = parse({"--stage", "2", "--config", path, "--micro-batch", "2"});
  CHECK(s.stage == 2);
  CHECK(s.micro_batch == 2);
  CHECK(s.accum == 3);
  // Keys DeepSpeed ignores are warnings; a near-miss of a real key and an
  // unknown key of a block DeepSpeed validates are errors that name the key;
  // every refused key of a file is in the one message.
  auto flag_error_of = [&](std::vector<std::string> arguments) -> std::string {
    try {
      parse(arguments);
    } catch (const z2::Error& e) { return e.what(); }
    return "";
  };
  auto error_of = [&](const std::string& text) -> std::string {
    write(text);
    return flag_error_of({"--config", path});
  };
  CHECK(error_of(R"({"train_micro_batch_size_per_gp": 4})")
            .find("\n  train_micro_batch_size_per_gp: not a DeepSpeed key this trainer knows (did you mean "
                  "'train_micro_batch_size_per_gpu'?)") != std::string::npos);
  write(R"({"train_micro_batch_size": 4, "fp16": {"enabled": false, "scale": 1}})");
  s = parse({"--config", path});
  REQUIRE(s.config_warnings.size() == 2);
  CHECK(s.config_warnings[1].find("'train_micro_batch_size' is not a key DeepSpeed reads") != std::string::npos);
  CHECK(s.config_warnings[0].find("'fp16.scale' is not a key DeepSpeed reads") != std::string::npos);
  CHECK(s.micro_batch == 8);  // ignored, as DeepSpeed ignores it
  CHECK(error_of(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})")
            .find("zero_optimization.offload_optimizer.device: \"nvme\" is not supported: NVMe offload "
                  "(ZeRO-Infinity) is not implemented") != std::string::npos);
  // ZeRO-Offload: offload_optimizer.device "cpu" and the old cpu_offload true
  // both mean --offload-optimizer cpu; pin_memory false (0.16.9's default) is
  // a note (zero2 pins anyway); NVMe-only keys away from their default warn.
  auto holds_line = [](const std::vector<std::string>& lines, const std::string& text) {
    return std::any_of(lines.begin(), lines.end(), [&](auto& line) { return line.find(text) != std::string::npos; });
  };
  write(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 8}},
           "optimizer": {"type": "AdamW"}})");
  s = parse({"--config", path});
  CHECK(s.offload_optimizer == "cpu");
  // Under offload DeepSpeed builds DeepSpeedCPUAdam, not FusedAdam (engine.py
  // _configure_basic_optimizer): the header names it, and the flag's
  // offload over a file without one names it too; --offload-optimizer none
  // over the file's names FusedAdam.
  CHECK(s.origins.at("--weight-decay") == "deepspeed_default:DeepSpeedCPUAdam");
  CHECK(parse({"--config", path, "--offload-optimizer", "none"}).origins.at("--weight-decay") ==
        "deepspeed_default:FusedAdam");
  CHECK(s.origins["--offload-optimizer"] == "config:zero_optimization.offload_optimizer.device");
  // (Its own field: the header prints it only while the run offloads.)
  CHECK(s.config_pinning_note.find("pin_memory false (DeepSpeed 0.16.9's default): zero2 pins") != std::string::npos);
  CHECK(!holds_line(s.config_notes, "zero2 pins"));
  CHECK(holds_line(s.config_warnings, "'zero_optimization.offload_optimizer.buffer_count' serves NVMe offload"));
  CHECK(bert::engine_options(s, z2::Precision::fp32).offload_optimizer);
  write(R"({"zero_optimization": {"stage": 1, "cpu_offload": true, "cpu_offload_use_pin_memory": true},
           "zero_force_ds_cpu_optimizer": false})");
  s = parse({"--config", path});
  CHECK(s.offload_optimizer == "cpu");
  CHECK(holds_line(s.config_notes, "zero_force_ds_cpu_optimizer false: ZeRO-Offload steps the client's optimizer"));
  CHECK(holds_line(s.config_warnings, "cpu_offload_use_pin_memory' is deprecated"));
  write(R"({"zero_optimization": {"stage": 2}})");
  CHECK(parse({"--config", path}).origins["--offload-optimizer"] == "deepspeed_default:DeepSpeedZeroConfig");
  // A number is quoted as the file writes it, -0 included (JSON's integer -0 is 0 once read).
  CHECK(error_of(R"({"train_micro_batch_size_per_gpu": -0})").find("(got '-0')") != std::string::npos);
  CHECK(error_of(R"({"train_micro_batch_size_per_gpu": "-5 \" 1e3", "gradient_accumulation_steps": -0})")
            .find("(got '-0')") != std::string::npos);
  CHECK(error_of(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})")
            .find("offload_optimizer.ratio: wants a number from 0 to 1") != std::string::npos);
  CHECK(error_of(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": true}}})")
            .find("did you mean 'zero_optimization.offload_optimizer.pin_memory'?") != std::string::npos);
  CHECK(flag_error_of({"--offload-optimizer", "cpu", "--stage", "0"}).find("needs ZeRO stage 1 or 2") !=
        std::string::npos);
  const std::string two =
      error_of(R"({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}, "zero_optimization": {"stage": 4}})");
  CHECK(two.find("has 2 settings") != std::string::npos);
  CHECK(two.find("optimizer.params.momentum: a DeepSpeed feature not implemented here (SGD's parameter") !=
        std::string::npos);
  // A bad value names the config key the user wrote, not the flag it maps to.
  CHECK(two.find("zero_optimization.stage: wants an integer from 0 to 2") != std::string::npos);
  CHECK(error_of(R"({"zero_optimization": {"stage": 3}})").find("zero_optimization.stage: 3 is not supported") !=
        std::string::npos);
  // DeepSpeed's warmup default is "log", and a scheduler block without warmup_type gets it.
  write(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}}})");
  s = parse({"--config", path});
  CHECK(s.warmup_type == "log");
  CHECK(s.schedule_convention == "deepspeed");
  CHECK(s.lr == 0.001);                      // WarmupLR's warmup_max_lr default
  CHECK(parse({}).warmup_type == "linear");  // without a config, the trainer's own linear warmup
  CHECK(parse({}).schedule_convention == "zero2");
  // WarmupDecayLR's total_num_steps has no default in DeepSpeed.
  write(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})");
  CHECK(flag_error_of({"--config", path}).find("'scheduler.params.total_num_steps' is missing") != std::string::npos);
  CHECK(parse({"--config", path, "--schedule-steps", "40"}).schedule_steps == 40);
  // What a file leaves out is DeepSpeed's: stage 0, no clip, FusedAdam's
  // weight decay 0 (torch.optim.AdamW's 0.01 with torch_adam), no
  // scheduler; an fp16 block without scaler keys gets DynamicLossScaler()'s
  // 2^32 and hysteresis 1. Flags still win; "auto" keeps the trainer's.
  write(R"({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "fp16": {"enabled": true}})");
  s = parse({"--config", path});
  CHECK(s.stage == 0);
  CHECK(s.clip == 0);
  CHECK(s.weight_decay == 0);
  CHECK(s.schedule_convention == "none");
  CHECK(s.loss_scaling.initial_scale_power == 32);
  CHECK(s.loss_scaling.hysteresis == 1);
  CHECK(s.origins.at("--weight-decay") == "deepspeed_default:FusedAdam");
  s = parse({"--config", path, "--stage", "2", "--clip", "0.5"});
  CHECK(s.stage == 2);
  CHECK(s.clip == 0.5);
  CHECK(s.origins.at("--clip") == "flag:--clip");
  write(R"({"optimizer": {"type": "AdamW", "params": {"torch_adam": true}}, "gradient_clipping": "auto"})");
  s = parse({"--config", path});
  CHECK(s.weight_decay == 0.01);
  CHECK(s.origins.at("--weight-decay") == "deepspeed_default:torch.optim.AdamW");
  CHECK(s.clip == 1.0);
  CHECK(s.origins.at("--clip") == "trainer_default:auto");
  CHECK(error_of("{not json").find("not valid JSON") != std::string::npos);
  // Mixed precision (notes/08): DeepSpeed's fp16 block, keys and defaults.
  write(R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
                     "hysteresis": 3, "min_loss_scale": 0.25, "consecutive_hysteresis": true},
           "data_types": {"grad_accum_dtype": "float16"}})");
  s = parse({"--config", path});
  CHECK(s.precision == "fp16");
  CHECK(s.grad_accum_dtype == "fp16");
  CHECK(s.loss_scaling.static_scale == 0);
  CHECK(s.loss_scaling.initial_scale_power == 12);
  CHECK(s.loss_scaling.window == 50);
  CHECK(s.loss_scaling.hysteresis == 3);
  CHECK(s.loss_scaling.min_scale == 0.25);
  CHECK(s.loss_scaling.consecutive_hysteresis);
  CHECK(parse({"--config", path, "--precision", "fp16"}).precision == "fp16");  // they agree
  write(R"({"bf16": {"enabled": true}})");
  CHECK(parse({"--config", path}).precision == "bf16");
  // Without a config, the fp16 section's defaults (DeepSpeed's constants.py).
  s = parse({"--precision", "fp16"});
  CHECK(s.loss_scaling.static_scale == 0);
  CHECK(s.loss_scaling.initial_scale_power == 16);
  CHECK(s.loss_scaling.window == 1000);
  CHECK(s.loss_scaling.hysteresis == 2);
  CHECK(s.loss_scaling.min_scale == 1);
  CHECK(!s.loss_scaling.consecutive_hysteresis);
  CHECK(s.grad_accum_dtype == "fp32");
  // A disabled block's scaler keys are not read (DeepSpeed reads them only
  // with fp16 on): not even a value out of range is refused, and the header says so.
  write(R"({"fp16": {"enabled": false, "loss_scale": 128, "min_loss_scale": -1}})");
  s = parse({"--config", path});
  CHECK(s.precision == "fp32");
  CHECK(s.loss_scaling.static_scale == 0);
  CHECK(holds_line(s.config_notes, "fp16.loss_scale, fp16.min_loss_scale not read: the run trains in fp32"));
  write(R"({"fp16": {"enabled": true, "min_loss_scale": 0}})");  // DeepSpeed's no-floor scaler
  CHECK(parse({"--config", path}).loss_scaling.min_scale == 0);
  // No batch key: refused as DeepSpeed refuses it, unless --micro-batch gives it.
  std::ofstream(path) << R"({"gradient_accumulation_steps": 2})";
  CHECK(flag_error_of({"--config", path}).find("gives neither train_batch_size nor train_micro_batch_size_per_gpu") !=
        std::string::npos);
  CHECK(parse({"--config", path, "--micro-batch", "3"}).micro_batch == 3);
  // Contradictions and bad values name the key or the flag.
  CHECK(error_of(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})").find("both true") != std::string::npos);
  CHECK(error_of(R"({"fp16": {"enabled": 1}})").find("fp16.enabled: wants true or false") != std::string::npos);
  CHECK(error_of(R"({"fp16": {"enabled": true, "loss_scale": -1}})").find("fp16.loss_scale: wants") !=
        std::string::npos);
  CHECK(error_of(R"({"fp16": {"enabled": true, "min_loss_scale": -1}})").find("fp16.min_loss_scale: wants") !=
        std::string::npos);
  CHECK(error_of(R"({"fp16": {"enabled": true, "hysteresis": 0}})").find("fp16.hysteresis: wants") !=
        std::string::npos);
  CHECK(error_of(R"({"fp16": {"enabled": true, "loss_scale_window": 0}})").find("fp16.loss_scale_window: wants") !=
        std::string::npos);
  CHECK(error_of(R"({"fp16": {"fp16_master_weights_and_grads": true}})")
            .find("fp16.fp16_master_weights_and_grads: true is not supported") != std::string::npos);
  CHECK(
      error_of(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp16"}})").find("grad_accum_dtype") !=
      std::string::npos);
  auto flag_error = [&](std::vector<std::string> arguments) -> std::string {
    try {
      parse(arguments);
    } catch (const z2::Error& e) { return e.what(); }
    return "";
  };
  write(R"({"fp16": {"enabled": false}})");
  CHECK(flag_error({"--config", path, "--precision", "fp16"}).find("contradicts config key 'fp16.enabled' = false") !=
        std::string::npos);
  write(R"({"bf16": {"enabled": true}})");
  CHECK(flag_error({"--config", path, "--precision", "fp16"}).find("contradicts config key 'bf16.enabled' = true") !=
        std::string::npos);
  CHECK(flag_error({"--precision", "fp8"}).find("--precision wants fp32|bf16|fp16") != std::string::npos);
  // train_batch_size without gradient_accumulation_steps: DeepSpeed derives
  // the accumulation (32 = 8 x A x 2 ranks gives A = 2); with it, they must agree.
  write(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8})");
  s = parse({"--config", path});
  bert::check_consistency(s, 2);
  CHECK(s.accum == 2);
  s = parse({"--config", path, "--accum", "3"});
  bool refused = false;
  try {
    bert::check_consistency(s, 2);
  } catch (const z2::Error&) { refused = true; }
  CHECK(refused);
  // Keys that change no arithmetic in DeepSpeed are accepted with a note of
  // what DeepSpeed would do (printing, logging, timing, a model-parallel
  // split of size 1); their blocks' unknown fields are refused, as
  // DeepSpeed's pydantic models refuse them; what would change the
  // arithmetic stays refused by name.
  write(R"({"dump_state": true, "tensorboard": {"enabled": true, "output_path": "tb"}, "wandb": {"enabled": true},
           "csv_monitor": {"enabled": true}, "comet": {"enabled": true, "project": "p"},
           "activation_checkpointing": {"profile": true, "partition_activations": true},
           "tensor_parallel": {"autotp_size": 1}})");
  s = parse({"--config", path});
  for (const char* note :
       {"dump_state true: DeepSpeed would print", "tensorboard.enabled true: DeepSpeed would log", "wandb.enabled true",
        "csv_monitor.enabled true", "comet.enabled true", "activation_checkpointing.profile true: DeepSpeed would time",
        "activation_checkpointing.partition_activations true: DeepSpeed splits",
        "tensor_parallel: autotp_size 1 leaves the model whole"})
    CHECK_MESSAGE(holds_line(s.config_notes, note), note);
  CHECK(s.activations == "keep");  // partition_activations alone asks for no checkpointing
  const std::string arithmetic = error_of(
      R"({"tensor_parallel": {"autotp_size": 2, "tp_size": 2}, "tensorboard": {"enabled": true, "path": "tb"},
          "activation_checkpointing": {"profile": 1}})");
  CHECK(arithmetic.find("has 4 settings") != std::string::npos);
  CHECK(arithmetic.find("tensor_parallel.autotp_size: 2 is not supported: AutoTP") != std::string::npos);
  CHECK(arithmetic.find("tensor_parallel.tp_size: not a field of DeepSpeed's TPTrainingConfig") != std::string::npos);
  CHECK(arithmetic.find("tensorboard.path: not a field of DeepSpeed's tensorboard monitor") != std::string::npos);
  CHECK(arithmetic.find("activation_checkpointing.profile: wants true or false") != std::string::npos);
  // compile is DeepSpeed 0.16.9's CompileConfig: its twelve fields, no
  // other (pydantic forbids them: axolotl's "disable" and "backend" fail
  // DeepSpeed's start-up, so does "enabled"); deepcompile true is a feature
  // not here; DeepCompile's options without it change nothing (a note).
  const std::string compiled =
      error_of(R"({"compile": {"disable": false, "backend": "inductor", "enabled": false, "deepcompile": true,
                               "double_bufer": true}})");
  CHECK(compiled.find("has 5 settings") != std::string::npos);
  CHECK(compiled.find("compile.disable: not a field of DeepSpeed 0.16.9's CompileConfig") != std::string::npos);
  CHECK(compiled.find("compile.backend: not a field of DeepSpeed 0.16.9's CompileConfig") != std::string::npos);
  CHECK(compiled.find("compile.enabled: not a field") != std::string::npos);
  CHECK(compiled.find("compile.deepcompile: true is not supported: DeepCompile") != std::string::npos);
  CHECK(compiled.find("(did you mean 'compile.double_buffer'?)") != std::string::npos);
  write(R"({"compile": {"deepcompile": false, "free_activation": true, "double_buffer": false,
                        "sync_after_allgather": "auto"}})");
  s = parse({"--config", path});
  CHECK(holds_line(s.config_notes, "compile: double_buffer, free_activation set DeepCompile's options"));
  CHECK(error_of(R"({"compile": {"debug_log": 1}})").find("compile.debug_log: wants true or false") !=
        std::string::npos);
  // The optimizer under offload (DeepSpeed 0.16.9's DeepSpeedCPUAdam, ops/adam/cpu_adam.py):
  // set_grad_none is FusedAdam's (TypeError there), fp32_optimizer_states is
  // DeepSpeedCPUAdam's (false keeps the moments in the fp32 master's type:
  // noted; without offload, FusedAdam's TypeError), amsgrad is taken and
  // ignored (noted).
  const std::string offloaded = R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  CHECK(error_of("{" + offloaded + R"(, "optimizer": {"type": "AdamW", "params": {"set_grad_none": true}}})")
            .find("optimizer.params.set_grad_none: DeepSpeed's DeepSpeedCPUAdam (built under offload_optimizer) has "
                  "no 'set_grad_none' (DeepSpeed's call raises TypeError); it is FusedAdam's") != std::string::npos);
  write("{" + offloaded +
        R"(, "optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": false, "amsgrad": true}}})");
  s = parse({"--config", path});
  CHECK(holds_line(s.config_notes, "optimizer.params.fp32_optimizer_states false: DeepSpeedCPUAdam keeps"));
  CHECK(holds_line(s.config_notes, "optimizer.params.amsgrad true: DeepSpeedCPUAdam takes it and ignores it"));
  CHECK(error_of(R"({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": true}}})")
            .find("optimizer.params.fp32_optimizer_states: DeepSpeed's FusedAdam has no 'fp32_optimizer_states'") !=
        std::string::npos);
  CHECK(error_of(R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})")
            .find("optimizer.params.amsgrad: true is not supported") != std::string::npos);
  // No optimizer type under offload: the client's optimizer, which DeepSpeed
  // refuses (ZeRORuntimeException) unless zero_force_ds_cpu_optimizer is
  // false; judged with the run's offload, a flag's too.
  CHECK(error_of("{" + offloaded + "}")
            .find("config key 'zero_optimization.offload_optimizer.device' offloads the "
                  "optimizer, and the config file names no optimizer \"type\"") != std::string::npos);
  CHECK(flag_error_of({"--config", path, "--offload-optimizer", "none"}).empty());
  write(R"({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"set_grad_none": true}}})");
  CHECK(parse({"--config", path}).origins.at("--weight-decay") == "deepspeed_default:FusedAdam");
  write(R"({"zero_optimization": {"stage": 2}})");
  CHECK(flag_error_of({"--config", path, "--offload-optimizer", "cpu"})
            .find("--offload-optimizer cpu offloads the optimizer, and the config file names no optimizer") !=
        std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("SHA-256 of checkpoint files: FIPS 180-4's test vectors, streamed in any chunks") {
  // FIPS 180-4 / NIST CSRC example values (one block, two blocks, the
  // million-'a' message), and the empty string.
  CHECK(bert::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(bert::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  CHECK(bert::sha256_hex(two_blocks) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(bert::sha256_hex(million) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Streamed in pieces of 1, 63, 64, 65 and 1000 bytes: the same digest.
  for (size_t piece : {1, 63, 64, 65, 1000}) {
    bert::Sha256 sha;
    for (size_t at = 0; at < million.size(); at += piece)
      sha.update(million.data() + at, std::min(piece, million.size() - at));
    CHECK_MESSAGE(sha.hex() == bert::sha256_hex(million), "pieces of ", piece);
  }
}

TEST_CASE("BERT learning-rate schedule: linear warmup to lr, then linear decay that still learns at the last step") {
  bert::Settings s;
  s.lr = 1.0, s.steps = 10, s.warmup = 4;
  CHECK(bert::learning_rate(s, 1) == 0.25);
  CHECK(bert::learning_rate(s, 4) == 1.0);
  CHECK(bert::learning_rate(s, 5) == 1.0);
  CHECK(bert::learning_rate(s, 10) == doctest::Approx(1.0 / 6));
  s.warmup = 0;
  CHECK(bert::learning_rate(s, 1) == 1.0);
  CHECK(bert::learning_rate(s, 10) == doctest::Approx(0.1));
}

TEST_CASE("BERT learning-rate schedule under a config: DeepSpeed's WarmupDecayLR as its engine steps it, or constant") {
  bert::Settings s;
  s.schedule_convention = "deepspeed";
  s.lr = 1.0, s.warmup_min_lr = 0.0, s.schedule_steps = 10, s.warmup = 4, s.warmup_type = "linear";
  // Update t at iteration t - 2: updates 1 and 2 at warmup_min_lr, then i / W.
  CHECK(bert::learning_rate(s, 1) == 0.0);
  CHECK(bert::learning_rate(s, 2) == 0.0);
  CHECK(bert::learning_rate(s, 3) == 0.25);
  CHECK(bert::learning_rate(s, 6) == 1.0);                       // i = 4 = W: the decay's start
  CHECK(bert::learning_rate(s, 7) == doctest::Approx(5.0 / 6));  // (S - i) / (S - W)
  CHECK(bert::learning_rate(s, 12) == 0.0);                      // i = S
  s.warmup = 1;                                                  // W = max(2, 1)
  CHECK(bert::learning_rate(s, 3) == 0.5);
  s.decay = "none";
  CHECK(bert::learning_rate(s, 40) == 1.0);
  s.schedule_convention = "none";  // a config without a scheduler: the optimizer's rate
  CHECK(bert::learning_rate(s, 1) == 1.0);
}

TEST_CASE("BERT sizes: parameter_count (the fit check's input) equals what the engine registers") {
  bool all_ok = true;
  for (const auto& backend : harness::sub_world(1)) {
    if (!backend.deterministic) continue;
    for (bert::Settings settings : {tiny_settings(), bert::Settings()}) {
      z2::EngineOptions options;
      z2::Engine engine(*backend.compute, *backend.deterministic, options);
      bert::Model<float> model(*backend.compute, engine, bert::shape_of(settings));
      engine.build();
      all_ok &= engine.psi() == bert::parameter_count(bert::shape_of(settings));
      MESSAGE(backend.name << ": Psi " << engine.psi());
    }
  }
  CHECK(harness::agree(all_ok, "parameter_count differs from the registered parameters"));
}

// --- ZeRO-R: activation modes x allocators, in process ----------------------
//
// bert::train() itself, as the command line runs it, on every rank of the
// test's world (N = 1, 2, 4 under tests/run_tests.sh), for stages 0, 1, 2 and
// all --activations x --alloc. Rank 0 reads each run's JSON summary.
namespace {

struct ZeroRRun {
  bool ok = false;
  std::string bits;  // final hash and every step's loss bits
  nlohmann::json summary;
};

ZeroRRun run_trainer(bert::Settings settings, const std::string& path) {
  ZeroRRun run;
  settings.json_path = path, settings.quiet = true;
  try {
    run.ok = bert::train(settings, MPI_COMM_WORLD) == 0;
  } catch (const std::exception& error) {  // every rank throws alike (bert::train's contract)
    if (harness::rank() == 0) fprintf(stderr, "train: %s\n", error.what());
  }
  if (run.ok && harness::rank() == 0) {
    std::ifstream in(path);
    run.summary = nlohmann::json::parse(in);
    run.bits = run.summary["final_params_hash"].get<std::string>();
    for (auto& step : run.summary["steps"]) run.bits += " " + step["loss_bits"].get<std::string>();
  }
  return run;
}

}  // namespace

std::string harness::bert_run_bits(const std::vector<std::string>& flags) {
  std::vector<char*> argv{(char*)"train_bert_mini"};
  for (const std::string& flag : flags) argv.push_back((char*)flag.c_str());
  const std::string path = "/tmp/z2_test_bert_run_" + std::to_string((long)getpid()) + ".json";
  const ZeroRRun run = run_trainer(bert::parse_command_line((int)argv.size(), argv.data()), path);
  if (harness::rank() == 0) std::remove(path.c_str());
  return run.ok ? run.bits : "";
}

TEST_CASE(
    "ZeRO-R: keep/recompute/offload x arena/naive give the caching allocator's bits in every stage and precision; "
    "ledgers hold") {
  const int N = harness::world_size();
  // Only rank 0 writes the summary, to its own file.
  const std::string path = "/tmp/z2_test_zero_r_" + std::to_string((long)getpid()) + ".json";
  std::vector<std::string> devices = {"cpu"};
  std::string why;
  if (z2::cuda_available(&why)) devices.push_back("cuda");
  bool all_ok = true;
  std::map<std::string, std::string> bits_by_precision;  // one hash per precision, whatever the stage
  for (const std::string& device : devices)
    for (const std::string precision : {"fp32", "bf16", "fp16"}) {
      const size_t element = precision == "fp32" ? 4 : 2;
      for (int stage = 0; stage <= 2; ++stage) {
        bert::Settings settings = tiny_settings();
        settings.layers = 3, settings.steps = 2, settings.warmup = 1, settings.accum = 4 / N;
        settings.device = device, settings.comm = "mpi", settings.stage = stage, settings.bucket = 600;
        // The reference: keep, and --alloc caching (the model of PyTorch's caching allocator), which
        // shares no code with the arena or the naive free list it is compared with.
        settings.activations = "keep", settings.alloc = "caching", settings.precision = precision;
        const ZeroRRun reference = run_trainer(settings, path);
        all_ok &= reference.ok;
        if (harness::rank() == 0 && reference.ok) {
          const std::string key = device + " " + precision;
          if (!bits_by_precision.count(key)) bits_by_precision[key] = reference.bits;
          all_ok &= bits_by_precision[key] == reference.bits;  // the same bits in every stage
          all_ok &= reference.summary["precision"] == precision;
        }
        for (std::string activations : {"keep", "recompute", "offload"})
          for (std::string alloc : {"arena", "naive"}) {
            settings.activations = activations, settings.alloc = alloc;
            const ZeroRRun run = run_trainer(settings, path);
            all_ok &= run.ok;
            if (harness::rank() != 0 || !run.ok || !reference.ok) continue;
            const auto& memory = run.summary["memory"];
            const size_t peak = memory["activation_peak_bytes"], formula = run.summary["activation_peak_formula_bytes"];
            const size_t bound = run.summary["offload_activation_bound_bytes"];
            const long after_step1 = memory["device_allocations_after_step1"];
            const long per_step = memory["device_allocations_per_step"];
            bool ok = run.bits == reference.bits && !run.bits.empty();
            ok &= peak == formula;  // the ledger's activation peak is the formula's, to the byte
            if (activations == "offload") ok &= peak <= bound;
            // The arena allocates nothing once step 1 is over; naive allocates every step.
            ok &= alloc == "arena" ? after_step1 == 0 && per_step == 0 : per_step > 0;
            ok &= memory["host_offload_peak_bytes"].get<size_t>() ==
                  (activations == "offload"
                       ? (size_t)(settings.layers - 1) * settings.micro_batch * settings.seq * settings.hidden * element
                       : 0);
            if (!ok)
              fprintf(stderr,
                      "%s %s stage %d %s/%s: bits %s vs %s; activation peak %zu formula %zu bound %zu; "
                      "allocations after step 1 %ld, per step %ld\n",
                      device.c_str(), precision.c_str(), stage, activations.c_str(), alloc.c_str(), run.bits.c_str(),
                      reference.bits.c_str(), peak, formula, bound, after_step1, per_step);
            all_ok &= ok;
          }
      }
    }
  // Three precisions, three different results (16-bit rounding shows).
  if (harness::rank() == 0)
    all_ok &= bits_by_precision["cpu fp32"] != bits_by_precision["cpu bf16"] &&
              bits_by_precision["cpu bf16"] != bits_by_precision["cpu fp16"] &&
              bits_by_precision["cpu fp32"] != bits_by_precision["cpu fp16"];
  if (harness::rank() == 0) std::remove(path.c_str());
  CHECK(harness::agree(all_ok, "a ZeRO-R mode changed the bits or broke a ledger rule"));
}

TEST_CASE("ZeRO-R: offload's measured peak is its bound, one block plus two checkpoints, at 2 and at 6 layers") {
  // The bound from the configuration alone, for a shape where a block's
  // backward is the largest phase (B 4, T 32, H 64, F 256, 2 heads): R = 128
  // rows, A = 4 x 2 x 32 x 32 probabilities, S = 4 x 30 head rows.
  bert::Settings settings;
  settings.hidden = 64, settings.heads = 2, settings.intermediate = 256, settings.seq = 32, settings.micro_batch = 4;
  settings.steps = 1, settings.warmup = 0, settings.dropout = 0.1f;
  const size_t R = 128, H = 64, F = 256, A = 4 * 2 * 32 * 32, S = 4 * 30, V = 260;
  const size_t working_set = (7 * R * H + A + 2 * R * F + 4 * R) * 4;
  const size_t scratch = (2 * R * H + R * std::max(2 * H, F) + 2 * A) * 4;  // dropout on: dropped probs too
  const size_t always = (2 * R + 2 * S + V + 1) * 4 + S * 4, backward_long = (V * H + R * H) * 4;
  const size_t bound = always + backward_long + working_set + scratch + 2 * R * H * 4;
  const std::string path = "/tmp/z2_test_zero_r_bound_" + std::to_string((long)getpid()) + ".json";
  bool all_ok = true;
  size_t peak[2][2] = {};  // [keep, offload][2 layers, 6 layers]
  for (int mode = 0; mode < 2; ++mode)
    for (int depth = 0; depth < 2; ++depth) {
      settings.activations = mode == 0 ? "keep" : "offload", settings.layers = depth == 0 ? 2 : 6;
      const ZeroRRun run = run_trainer(settings, path);
      all_ok &= run.ok;
      if (run.ok && harness::rank() == 0) peak[mode][depth] = run.summary["memory"]["activation_peak_bytes"];
      if (run.ok && harness::rank() == 0 && mode == 1)
        all_ok &= run.summary["offload_activation_bound_bytes"].get<size_t>() == bound;
    }
  if (harness::rank() == 0) {
    std::remove(path.c_str());
    MESSAGE("offload peak " << peak[1][0] << " and " << peak[1][1] << " bytes (bound " << bound << "); keep "
                            << peak[0][0] << " and " << peak[0][1]);
    all_ok &= peak[1][0] == bound && peak[1][1] == bound;  // measured, to the byte, and independent of depth
    all_ok &= peak[0][1] > peak[0][0] + 3 * working_set;   // keep holds four more working sets at 6 layers
  }
  CHECK(harness::agree(all_ok, "offload's measured peak is not its bound, or keep does not grow with depth"));
}

namespace {

// One precision's part of the test below: every mode and allocator, against
// the first one's loss and gradient bits.
template <class Act>
bool buffers_come_back() {
  const bert::Settings settings = tiny_settings();
  const std::string corpus = bert::default_corpus();
  const long step = 3;
  bert::Batch batch = bert::make_batch(corpus, settings.seed, step, 0, settings.micro_batch, settings.seq);
  const float scale = 1.0f / (float)std::max<size_t>(1, batch.selected.size());
  bool all_ok = true;
  float reference_loss = 0.0f;
  std::vector<float> reference_gradient;
  bert::ModelShape shape = bert::shape_of(settings);
  shape.precision = z2::precision_of<Act>();
  for (auto mode : {bert::ActivationMode::keep, bert::ActivationMode::recompute, bert::ActivationMode::offload})
    for (auto allocator : {z2::Allocator::arena, z2::Allocator::naive, z2::Allocator::caching}) {
      try {
        z2::Compute compute(z2::Device::cpu);
        compute.use_allocator(allocator, 64 << 20);
        z2::Communicator comm(compute, MPI_COMM_SELF, z2::CommBackend::mpi, z2::Collectives::deterministic);
        z2::EngineOptions options;
        options.stage = 0, options.bucket_elements = 4096, options.precision = shape.precision;
        z2::Engine engine(compute, comm, options);
        bert::Model<Act> model(compute, engine, shape, mode);
        engine.build();
        model.initialize();
        const size_t live_before = compute.memory().current[(int)z2::MemoryKind::activations];
        size_t free_before = 0, pieces_before = 0, largest_before = 0;
        compute.free_space(&free_before, &pieces_before, &largest_before);
        auto unchanged = [&] {
          size_t free = 0, pieces = 0, largest = 0;
          compute.free_space(&free, &pieces, &largest);
          // (caching keeps the segments a step added, as cached free blocks:
          // the free bytes come back, their pieces need not.)
          return compute.memory().current[(int)z2::MemoryKind::activations] == live_before && free == free_before &&
                 (pieces == pieces_before || allocator == z2::Allocator::caching);
        };
        const float loss_only = model.run(batch, step, 0, scale, false);
        all_ok &= unchanged();
        const float loss = model.run(batch, step, 0, scale, true);
        all_ok &= unchanged();
        const std::vector<float> gradient = engine.gradients_to_host();
        all_ok &= std::memcmp(&loss_only, &loss, sizeof loss) == 0;
        if (reference_gradient.empty()) reference_loss = loss, reference_gradient = gradient;
        all_ok &=
            std::memcmp(&loss, &reference_loss, sizeof loss) == 0 && harness::same_bits(gradient, reference_gradient);
      } catch (const std::exception& error) {
        fprintf(stderr, "%s mode %d, %s: %s\n", z2::to_string(shape.precision), (int)mode, z2::to_string(allocator),
                error.what());
        all_ok = false;
      }
    }
  return all_ok;
}

}  // namespace

TEST_CASE(
    "ZeRO-R: loss-only and full micro-steps give every buffer back, stack in order, in every mode and precision") {
  // What the finite-difference test does (run with backward = false), but
  // with the arena, naive and caching allocators: a pop out of order throws, a buffer
  // left open shows in the live bytes or the free pieces. Rank-local (its own
  // communicator over MPI_COMM_SELF), so every rank checks it on its own.
  const bool all_ok =
      buffers_come_back<float>() && buffers_come_back<z2::bfloat16>() && buffers_come_back<z2::float16>();
  CHECK(
      harness::agree(all_ok, "a micro-step left a buffer open, popped out of order, or changed the loss or gradient"));
}
