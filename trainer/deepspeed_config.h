// trainer/deepspeed_config.h — a DeepSpeed configuration file read as
// DeepSpeed reads it (--config): the flags it sets, the keys refused with
// their reasons, the notes for the header. Its own file because it is the
// one place that knows DeepSpeed's keys, and the JSON library's reader with
// them (trainer/deepspeed_config.cpp); the command line (trainer/settings.cpp)
// applies what it returns.
#pragma once

#include <string>
#include <vector>

namespace bert {

// A DeepSpeed configuration file, read as DeepSpeed reads it (notes/07,
// "DeepSpeed configs"). Every key DeepSpeed documents that matters here
// either becomes the flag it corresponds to, or is accepted because it
// changes nothing here (the reason is in a comment beside it), or is refused
// with its reason; a key neither side knows is refused too, because silently
// ignoring a setting the user believes is in force is worse. All the refused
// keys of a file are listed in one message, not one per run. "auto" (the
// Hugging Face Trainer's placeholder, which it fills from its own arguments)
// leaves the setting to the command line or the default, as if absent.
struct ConfigSetting {
  std::string flag, value, key;  // the flag it acts as, its value as text, the config key (for messages)
};
struct ConfigReading {
  std::vector<ConfigSetting> flags;  // what the file sets, as flags, in the order to apply them
  std::vector<std::string> refused;  // "key: why", every refused key of the file
  std::vector<std::string> notes;    // accepted keys that act differently from DeepSpeed (printed in the header)
};

// The file's settings, refused keys and notes (the file is read and parsed
// here; the caller applies the flags and reports the refused keys).
ConfigReading read_deepspeed_config(const std::string& path);
// The config file as text, refused with its reason: not a regular file (a
// FIFO would block), larger than a config can be, a NUL byte, nested too
// deep. (Every rank fingerprints it: trainer/inputs.cpp.)
std::string read_config_text(const std::string& path);

}  // namespace bert
