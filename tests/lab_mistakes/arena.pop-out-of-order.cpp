// expect: a pop out of order was accepted
// A planted mistake for the arena lab: pop trusts its caller.
#include "zero2.h"
size_t z2::arena_allocate(ArenaBooks& books, size_t bytes) {
  if (bytes > books.top - books.bottom) return arena_full;
  books.bottom += bytes;
  return books.bottom - bytes;
}
size_t z2::arena_push(ArenaBooks& books, size_t bytes) {
  if (bytes > books.top - books.bottom) return arena_full;
  books.top -= bytes;
  books.stack.push_back(books.top);
  return books.top;
}
void z2::arena_pop(ArenaBooks& books, size_t offset, size_t bytes) {
  books.stack.pop_back();
  books.top += bytes;
}
void z2::arena_release(ArenaBooks& books, size_t offset, size_t bytes) {
  if (offset + bytes == books.bottom) books.bottom = offset;
}
