// trainer/deepspeed_config.h — a DeepSpeed configuration file read as
// DeepSpeed reads it (--config): the flags it sets, DeepSpeed's defaults for
// what it leaves out, the keys refused with their reasons, the notes and
// warnings for the header. Its own file because it is the
// one place that knows DeepSpeed's keys, and the JSON library's reader with
// them (trainer/deepspeed_config.cpp); the command line
// (trainer/command_line.cpp) applies what it returns.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <set>
#include <string>
#include <vector>

namespace bert {

// A DeepSpeed configuration file, read as DeepSpeed 0.16.9 reads it
// (notes/07, "DeepSpeed configs"), so that the same file gives the same run
// here and in DeepSpeed. Every key DeepSpeed reads either becomes the flag it
// corresponds to, or is accepted because it changes nothing here (the
// reason is in a comment beside it; a header note where DeepSpeed would do
// something, logging or printing, that zero2 does not), or is refused with
// its reason. A key
// DeepSpeed never reads is treated as DeepSpeed treats it: where DeepSpeed
// ignores unknown keys (the top level and the blocks it reads with
// dict.get) it is a warning, unless it is a near-miss of a real key (a
// typo, refused with the name it resembles); where DeepSpeed rejects them
// (zero_optimization's pydantic model, the optimizer's and the scheduler's
// constructor arguments) it is refused. All the refused keys of a file are
// listed in one message. "auto" (the Hugging Face Trainer's placeholder,
// which it fills from its own arguments) leaves the setting to the command
// line or the trainer's default; a key the file leaves out takes
// DeepSpeed's default (`defaults`, applied once the flags are known).
struct ConfigSetting {
  std::string flag, value, key;  // the flag it acts as, its value as text, the config key (for messages)
};
struct ConfigReading {
  std::vector<ConfigSetting> flags;     // what the file sets, as flags, in the order to apply them
  std::vector<ConfigSetting> defaults;  // DeepSpeed's defaults for what it leaves out (key: where DeepSpeed sets it)
  std::set<std::string> auto_flags;     // the flags whose key says "auto" (the trainer's default applies)
  std::vector<std::string> refused;     // "key: why", every refused key of the file
  // fp16's loss-scaler keys and their refusals, apart: DeepSpeed reads them
  // only when fp16 is on (runtime/config.py:195-242), so the command line
  // applies them, or refuses them, only in a run that trains in fp16.
  std::vector<ConfigSetting> fp16_flags;
  std::vector<std::string> fp16_refused;
  // train_batch_size or train_micro_batch_size_per_gpu is in the file ("auto"
  // too): DeepSpeed refuses a file with neither (runtime/config.py:979-981).
  bool batch_key_given = false;
  // prescale_gradients true, gradient_predivide_factor other than 1 (value:
  // as written): judged with the run's stage (trainer/command_line.cpp).
  std::vector<ConfigSetting> prescaling;
  std::vector<std::string> notes;       // accepted keys that act differently from DeepSpeed (printed in the header)
  // offload_optimizer's pin_memory false, which zero2 pins anyway: a note only
  // when the run offloads (--offload-optimizer none may override the file)
  std::string pinning_note;
  std::vector<std::string> warnings;  // keys DeepSpeed ignores (printed in the header, or to stderr with --quiet)
  // The schedule: "WarmupLR" or "WarmupDecayLR" when the file has a scheduler
  // block with that type, "" when it has none (DeepSpeed then keeps the
  // optimizer's rate); whether WarmupDecayLR's total_num_steps, which has no
  // default in DeepSpeed, is left out.
  std::string scheduler;
  bool total_num_steps_missing = false;
  // Whether the file names an optimizer type (else DeepSpeed trains the
  // client's, here the trainer's AdamW), and zero_force_ds_cpu_optimizer
  // (true unless the file says false): under offload DeepSpeed refuses a
  // client optimizer while it is true (engine.py _configure_optimizer),
  // judged once the run's offload is known (a flag may change it).
  bool optimizer_typed = false;
  bool force_ds_cpu_optimizer = true;
  // Hugging Face's Trainer fills optimizer.params.lr and
  // scheduler.params.warmup_max_lr from one argument, learning_rate, and
  // refuses a file whose explicit value of either differs from it (its
  // fill_match). Where either says "auto", the explicit ones are held to the
  // rate the run takes (trainer/command_line.cpp check_learning_rate_auto).
  bool learning_rate_auto = false;
  std::vector<ConfigSetting> learning_rate_keys;  // the explicit ones of those two keys
};
// The file's settings, refused keys and notes (the file is read and parsed
// here; the caller applies the flags and reports the refused keys).
ConfigReading read_deepspeed_config(const std::string& path);

}  // namespace bert
