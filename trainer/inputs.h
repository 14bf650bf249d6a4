// trainer/inputs.h — what the trainer reads: a file whole, refused with its
// reason when it cannot be an input (a FIFO, a device, too large), strict
// UTF-8 (the corpus, and every path the run records), and the check that
// every rank reads the same --data, --config and --load. Defined in
// trainer/inputs.cpp; the corpus itself is read by the model's data section
// (train_bert_mini.cu, read_corpus).
#pragma once

#include <cstddef>
#include <string>

#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// An input file, read whole: `what` names it in messages; at most `max_bytes`.
std::string read_regular_file(const std::string& what, const std::string& path, size_t max_bytes);
// The offset of the first byte of `text` that does not begin a well-formed
// UTF-8 sequence, or npos.
size_t first_bad_utf8(const std::string& text);
// On several hosts: every rank's --data (the corpus as read), --config,
// --load's index and --init-hf's weights (`initial_weights`, the file's
// bytes as read; "" without it) are the same bytes, or every rank stops
// with one message.
void check_same_inputs(const Settings& settings, const std::string& corpus, const std::string& initial_weights,
                       MPI_Comm world);

}  // namespace bert
