// trainer/embedded_corpus.cpp — data/corpus.txt compiled in as one string,
// so `make run` trains with no download and no file at run time (the
// Makefile writes the file out as DIR/corpus.inc, a C++ raw string). A file
// of its own: only it waits for the generated text, so the model's long
// compile starts at once, and only it is rebuilt when the corpus changes.
#include <string>

namespace bert {

const std::string& default_corpus() {
  static const std::string text =
#include "corpus.inc"
      ;
  return text;
}

}  // namespace bert
