// trainer/command_line.h — the command line: argv and a DeepSpeed config
// file (--config) into the run's Settings. The config's keys are applied
// first, whatever --config's position, so that every flag on the command
// line overrides the file; then what the file means to DeepSpeed beyond its
// keys (the schedule, DeepSpeed's defaults for what it leaves out), and the
// checks of flags that cannot go together. Above both the settings and the
// config reader, which knows nothing of argv; defined in
// trainer/command_line.cpp.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include "trainer/settings.h"

namespace bert {

// The command line. --config is read first, whatever its position, so that
// every flag given on the command line overrides the file.
Settings parse_command_line(int argc, char** argv);

}  // namespace bert
