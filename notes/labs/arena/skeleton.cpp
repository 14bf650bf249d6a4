// notes/labs/arena/skeleton.cpp — lab: the arena, a bump region and a LIFO
// stack in one block (ZeRO-R's contiguous memory).
// Copy this file, write the four functions, and grade them:
//   make lab LAB=arena SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/arena/README.md.
#include "zero2.h"

namespace z2 {

// books: capacity, bottom, top, stack (zero2.h, ArenaBooks). [0, bottom)
// holds long-lived buffers, [top, capacity) the stack; the middle is free.

// A long-lived buffer of `bytes` from the bottom: its offset, or arena_full.
size_t arena_allocate(ArenaBooks& books, size_t bytes) {
  // Yours here.
  return arena_full;
}

// A temporary of `bytes` from the top: its offset, or arena_full.
size_t arena_push(ArenaBooks& books, size_t bytes) {
  // Yours here.
  return arena_full;
}

// The temporary at `offset` back; it must be the last one pushed, else
// usage_error("...") (zero2.h) with a message that says so.
void arena_pop(ArenaBooks& books, size_t offset, size_t bytes) {
  // Yours here.
}

// The long-lived buffer at `offset` back.
void arena_release(ArenaBooks& books, size_t offset, size_t bytes) {
  // Yours here.
}

}  // namespace z2
