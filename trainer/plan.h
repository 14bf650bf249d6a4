// trainer/plan.h — the memory plan (--plan; notes/10): bytes per rank by
// category, from the flags alone (no engine, no model, no allocation), and the
// fit check before a run allocates its block. Apart from the model, whose
// sizes it reads (trainer/model_shape.h), and from the engine, whose buffers
// it lays out as Engine::build() would; defined in trainer/plan.cpp.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstddef>

#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// Refuse a configuration a rank cannot hold before allocating it; returns
// the one block each rank reserves.
size_t memory_block(const Settings& settings, z2::Allocator allocator, z2::Device device, int world_size,
                    MPI_Comm world);
// --plan: the tables (rank 0 prints them), and with --json the same as JSON.
int run_plan(Settings settings, MPI_Comm world);

}  // namespace bert
