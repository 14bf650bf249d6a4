// trainer/checkpoints.h — checkpoint files (--save, --load; notes/09): the
// index and its SHA-256, the rank files, resuming at any N and stage, and
// whose steps a --save directory holds. The model is not in a checkpoint
// (only its parameters' names and shapes are, to check against), so all of
// this is written once, not once per precision; defined in
// trainer/checkpoints.cpp, which alone reads and writes an index.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "trainer/model_shape.h"
#include "trainer/output_files.h"
#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// --load DIR, before anything else: the checkpoint's index read and
// verified into s.checkpoint, and its settings into `s` (a recorded setting
// not given is taken, one given with another value refused).
void adopt_checkpoint(Settings& s, int world_size);
// The loaded index as one line of JSON, for the ranks' fingerprints ("" without --load).
std::string loaded_index_text(const Settings& s);
// The data the checkpoint was trained on, byte for byte: `corpus`, or one message.
void check_checkpoint_data(const Settings& s, const std::string& corpus);

// What --load read, for the header, the summary and the JSON.
struct LoadedCheckpoint {
  std::string directory;
  long step = 0, world_size = 1, accum = 1, stage = 0;  // where it stands, and the run that saved it
  bool same_summation_tree = true;                      // false only with --allow-different-bits
  std::string precision;
  double seconds = 0;
};
// Every rank reads its part of the checkpoint into `engine` (collective).
LoadedCheckpoint load_checkpoint(const Settings& s, z2::Engine& engine, const TensorShapes& tensor_shapes,
                                 MPI_Comm world);

// Rank 0, before step 1: --save locked and claimed for this run (its run_id into `s`).
std::unique_ptr<DirectoryLock> claim_save_directory(Settings& s);
// What one save wrote, for the summary and the JSON.
struct SavedCheckpoint {
  std::string directory;
  long step = 0, bytes = 0;
  double seconds = 0;
};
// DIR/step_<s> of the engine's state now (collective).
SavedCheckpoint save_checkpoint(const Settings& s, z2::Engine& engine, const TensorShapes& tensor_shapes,
                                const std::string& corpus, MPI_Comm world);

}  // namespace bert
