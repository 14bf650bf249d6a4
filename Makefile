# zero2 — build, test and run.
#
#   make          build with nvcc if it is on PATH or in /usr/local/cuda (cpu + cuda
#                 compute, mpi + nccl communication), else with mpicxx alone (cpu + mpi)
#   make cpu      force the mpicxx-only build (into build-cpu/)
#   make run      train BERT-mini with stage 2 on 2 ranks on the embedded corpus
#   make demo     the engine demo: the three stages on the test MLP, 2 ranks
#   make test     the quick suite (build/, minutes): the doctest suite under mpirun -n 1, 2, 4, then one check
#                 per claim of the README through the command line (each tests/cli/*.sh file's quick checks)
#                 and the trace checker (tests/run_tests.sh; Z2_QUICK=1)
#   make test-all every check: the doctest suite and every tests/cli file whole, then test-cpu, labs,
#                 sanitize and check-peer PEER=torch, summed into one line (Z2_ALL=1 tests/run_tests.sh; what CI runs)
#   make test ONLY=checkpoints  (or ONLY="plan traces", and make test-all ONLY=...) only those: doctest,
#                 a file of tests/cli (stages, ledgers, bad_input, checkpoints, ...; the table in
#                 tests/run_tests.sh) or checker. A file also runs alone: tests/cli/checkpoints.sh build
#   make test-cpu the mpicxx-only build (build-cpu/) where its code differs from build/'s: the doctest suite
#                 once (N = 2) and the quick checks of the capabilities that compute bits (TEST_CPU_ONLY)
#   make sanitize the cpu build with AddressSanitizer and UBSan (build-sanitize/): the doctest suite
#                 at N = 1, 2, a short trainer matrix and 20 s of fuzzing the safetensors reader
#                 (tests/sanitize.sh)
#   make bench    tokens/s and sgemm share: fp32/bf16/fp16 x stage 0/2 x N = 1, 2; zero2 (both builds)
#                 vs PyTorch per core and on two cores; step-time ratios recompute / keep, offload / keep;
#                 last, make bench-host-adam's figures
#   make bench-host-adam  ZeRO-Offload's host AdamW beside DeepSpeedCPUAdam (10M, 50M parameters, 1 and
#                 2 threads; DeepSpeed where .venv-deepspeed exists) and the trainer's whole offloaded
#                 step at --host-threads 1, 2 (measurements/host_adam.sh; 2 min)
#   make fraglab  the smallest --device-memory-limit one BERT-mini step needs, for every
#                 --activations x --alloc (a binary search of one-step runs; it prints how long it took)
#   make plan     the memory plan (train_bert_mini --plan) of the default BERT-mini: bytes per rank
#                 by category for stages 0/1/2 and N = 1 .. 1024
#   make build-time BASE=REV  how long a fresh clone's make -j2 build/train_bert_mini takes at REV and
#                 at HEAD, built alternately, and the ratio (measurements/build_time.sh)
#   make paper-tables  the paper's Table 1 (7.5B, 128B, 1T) and Table 2's theoretical row from the
#                 formula the ledger and --plan use
#   make superlinear  tokens/s per rank at the largest micro-batch that fits a fixed memory per
#                 rank, stages 0 and 2 at N = 1, 2, 4 (demos/superlinear.sh)
#   make verify   does this build compute zero2's reference bits? The small rows of tests/golden_bits.txt
#                 in portable mode (--portable; notes/11), seconds after the build: "your build computes
#                 ..." or the configuration that differs. VERIFY_BUILD=build-cpu checks the mpicxx build
#   make golden   rewrite tests/golden_bits.txt from this build (only for a change meant to change bits)
#   make lab LAB=<name> [SOLUTION=<file>]  a course lab (notes/labs): zero2 with your function in
#                 place of the engine's, graded by the lab's tests at N = 1, 2, 4 ("N passed, M failed"
#                 and what differs first); torch-step: your step in the torch peer, graded by
#                 tests/check_trace.py at N = 2, 4. Without SOLUTION, the skeleton as shipped; SOLUTION=engine,
#                 zero2's own code. `make labs`: every lab is gradable (CI)
#   make check-trace REF=DIR THEIRS=DIR  another implementation's trace against zero2's (train_bert_mini
#                 --trace DIR): the first step and tensor that differ, where in ZeRO's terms, the likely bug
#   make check-peer PEER=torch  a peer replays zero2's trace and is checked (tests/peers/check_peer.sh):
#                 PyTorch's ZeroRedundancyOptimizer and zero2's step in torch.distributed agree, each
#                 planted mistake is diagnosed (CI)
#   make check-peer PEER=deepspeed  DeepSpeed's ZeRO-2 replays zero2's BERT-mini trace and is checked, then
#                 zero2 and DeepSpeed side by side: tokens/s, memory, bytes sent (tests/peers/side_by_side.sh);
#                 makes .venv-deepspeed from PyPI (5.3 GB) the first time. Not in CI
#   make check-peer PEER=fsdp  PyTorch's FSDP1 (SHARD_GRAD_OP) and FSDP2 (fully_shard) replay zero2's traces
#                 (fp32 and bf16, small and default size) and are checked; FSDP2 without its workaround for
#                 gloo's AVG-that-sums must fail, diagnosed; makes .venv-fsdp from PyPI (5.3 GB) the first
#                 time. Not in CI
#   make check-peer PEER=large  the same peers (and zero2 --portable) on a model of 25.9M parameters, fp32
#                 and bf16: the tolerances at 7.5x BERT-mini's size. Not in CI
#   make notes    regenerate the measured tables in notes/
#   make figures  regenerate the pictures in notes/figures/ (loss curve, memory over a step)
#   make deps     install missing Debian packages (as root), or print the command
#
# Every flag that matters is below; nothing is hidden in a script.

# --- what we need from Debian -------------------------------------------------
# To build and train (libssl-dev: OpenSSL's libcrypto, whose SHA-256 the
# checkpoints record). python3-torch (with numpy) is the independent reference
# the tests and the benchmark compare with, so only `make test` (and test-all), `bench` and
# `notes` ask for it; matplotlib only draws the figures (`make figures`).
PACKAGES := mpich libmpich-dev doctest-dev libopenblas-dev nlohmann-json3-dev libssl-dev
TEST_PACKAGES := python3-torch python3-numpy python3-venv
FIGURE_PACKAGES := python3-matplotlib
# `make sanitize` also fuzzes the safetensors reader: libFuzzer ships with
# clang's runtime libraries, not with g++.
SANITIZE_PACKAGES := clang-14 libclang-rt-14-dev
# The Hugging Face round trip (tests/hf_roundtrip.py) needs transformers,
# which Debian does not package: a venv on Debian's python (its torch and
# numpy) with these from PyPI, pinned. 4.39 is the newest line that runs on
# Debian's torch 1.13; an unpinned pip picks 5.x, which wants torch >= 2.6.
# Made once by `make test` (hf-venv); when PyPI cannot be reached there is
# no venv, and the test says SKIP with the reason.
HF_VENV := .venv-hf
HF_PACKAGES := transformers==4.39.3 tokenizers==0.15.2

# --- tools --------------------------------------------------------------------
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
MPICXX    ?= mpicxx
# NCCL sits in the CUDA directory with no dpkg entry: ask the compiler.
HASH      := \#
comma     := ,
HAVE_NCCL := $(shell printf '$(HASH)include <nccl.h>\nint main(){int v;return ncclGetVersion(&v);}\n' | \
               g++ -x c++ - -I$(CUDA_HOME)/include -L$(CUDA_HOME)/lib64 -lnccl -o /dev/null 2>/dev/null && echo yes)

# --- flags --------------------------------------------------------------------
# No -ffast-math (nor nvcc's --use_fast_math, -ftz=true, -prec-div=false or
# -prec-sqrt=false: nvcc's defaults are IEEE's): the determinism contract needs IEEE float semantics
# (fast-math would let the compiler reassociate our fixed summation order).
# No contraction of a * b + c into one fused multiply-add either: the canonical
# tree is defined on rounded products (a norm chunk sums rounded squares), and
# with -ffp-contract=off (g++) and -fmad=false (nvcc) the CPU loop and the CUDA
# kernel round the same way.
# -O3 and -march=native (as llm.c builds): the CPU loops are vectorised for
# this machine's vector unit. Neither changes a bit: without -ffast-math the
# compiler vectorises only element-by-element work, never a sum, and rounds
# each operation as the scalar code does. The binary then needs this CPU's
# instruction set: `make CPU_ARCH=` builds one for any x86-64 (the same bits,
# slower loops).
CPU_ARCH  ?= -march=native
# -fno-math-errno: sqrtf becomes one instruction (nothing here reads errno;
# the result is the same correctly rounded root). -fno-trapping-math: nothing
# here reads the floating-point exception flags either, so the compiler may
# compute both sides of a select on floats (exp_fp32's clamp, erf_fp32's +-1)
# and vectorise the loop around it; every value is rounded as before.
# -g1: line tables and function names, what a backtrace, a crash's file:line
# and a breakpoint by line need. Full -g (every variable and type as well)
# took a third of every compile, and at -O3 most variables show as
# <optimized out> anyway: `make DEBUG=-g` builds with it. Debug information
# never changes the code, so never a bit.
DEBUG     ?= -g1
CXXFLAGS  := -std=c++17 -O3 $(CPU_ARCH) $(DEBUG) -ffp-contract=off -fno-math-errno -fno-trapping-math -fopenmp -Wall \
             -Wextra -Wno-unused-parameter
# nvcc uses mpicxx as its host compiler, so MPI's include and link flags come
# along without nvcc having to parse them (it rejects some, e.g. -Wl,-z,relro).
# --extended-lambda lets a lambda be a kernel body (Z2_LOOP's __device__ half); sm_80 (A100) and
# sm_90 (H100/H200) machine code, plus compute_90 PTX for newer GPUs.
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]
NVCCFLAGS := -std=c++17 -O3 -ccbin $(MPICXX) --extended-lambda --expt-relaxed-constexpr $(CUDA_ARCH) \
             -fmad=false -Xcompiler -Wall,-Wno-unused-parameter,-ffp-contract=off,-fno-math-errno,-fno-trapping-math,-fopenmp$(if $(CPU_ARCH),$(comma)$(CPU_ARCH)) \
             -Xcompiler $(DEBUG)
# OpenBLAS (the cpu backend's sgemm) and OpenMP's runtime (-fopenmp, also in
# the compile flags): ZeRO-Offload's host step splits its loops over threads
# (runtime/compute.h, for_each_on_host).
HOST_LIBS := -lopenblas -fopenmp
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart
ifeq ($(HAVE_NCCL),yes)
NVCCFLAGS += -DZ2_HAVE_NCCL
CUDA_LIBS += -lnccl
endif

# --- what gets built ------------------------------------------------------------
# The engine: zero2.cu, the chapter on ZeRO-2, and runtime/, the machinery it
# runs on (zero2.h's map says which file holds what). The trainer: the model
# (train_bert_mini.cu, which holds main) and its plumbing in trainer/. Host-only
# code is a .cpp compiled by mpicxx; nvcc compiles the .cu files, which hold
# kernels. The slowest compile comes first in each list: make -j2 starts
# prerequisites in order, so the long one never waits for a short one.
ENGINE_SOURCES  := zero2.cu runtime/gemm.cu runtime/transfers.cpp runtime/checkpoint_state.cpp runtime/allocators.cpp \
                   runtime/communicator.cpp runtime/compute.cpp runtime/watchdog.cpp runtime/host_copies.cpp \
                   runtime/simulated_device.cpp runtime/ledger_report.cpp runtime/option_checks.cpp runtime/errors.cpp \
                   runtime/timeline.cpp
MODEL_SOURCE    := train_bert_mini.cu
TRAINER_SOURCES := trainer/checkpoints.cpp trainer/json.cpp trainer/deepspeed_config.cpp trainer/reports.cpp \
                   trainer/hf_export.cpp trainer/trace.cpp trainer/hf_import.cpp trainer/plan.cpp trainer/settings.cpp \
                   trainer/output_files.cpp trainer/inputs.cpp trainer/safetensors.cpp trainer/command_line.cpp \
                   trainer/step_observers.cpp trainer/embedded_corpus.cpp trainer/launcher.cpp
# What the trainer's plumbing links besides the engine's libraries: OpenSSL's
# libcrypto, whose SHA-256 the checkpoints record (trainer/inputs.cpp).
TRAINER_LIBS    := -lcrypto
TEST_SOURCES    := tests/test_bert.cu tests/mlp_model.cu tests/test_conversions_gpu.cu tests/test_main.cpp \
                   tests/test_collectives.cpp tests/test_engine.cpp tests/test_precision.cpp tests/test_checkpoint.cpp \
                   tests/test_allocator.cpp tests/test_math.cpp tests/test_portable.cpp tests/test_labs.cpp \
                   tests/test_offload.cpp tests/test_safetensors.cpp tests/test_schedules.cpp tests/test_lab_streams.cpp
# $(call objects,DIR,SOURCES): each source's object under DIR (zero2.cu -> DIR/zero2.o).
objects = $(patsubst %,$(1)/%.o,$(basename $(2)))
# Host-only code that runs once a run or once a step, never once an element
# -- the plumbing (runtime/*.cpp, trainer/*.cpp: messages, files, JSON, the
# transfer queue's bookkeeping) and the tests' own .cpp files (their
# harness and expected values; what they test is the engine's and the
# model's code, at -O3) -- gains nothing from -O3's vectorisation, which
# took most of its compile time: -Og, GCC's optimisation for code one
# debugs (a fifth faster to compile than -O1, as fast to run here). The
# arithmetic is the same IEEE arithmetic at any -O (no fast-math, no
# contraction): no bit changes. The chapter, the gemms and the model (.cu),
# and tools that compute (math_accuracy), keep -O3.
HOST_ONLY := $(filter %.cpp,$(ENGINE_SOURCES)) runtime/lab_checks.cpp $(TRAINER_SOURCES) $(filter %.cpp,$(TEST_SOURCES)) \
             demos/demo_stages.cpp tests/watchdog_check.cpp tests/sim_check.cpp measurements/paper_table.cpp
$(call objects,build,$(HOST_ONLY)) $(call objects,build-cpu,$(HOST_ONLY)): HOST_ONLY_FLAGS := -Og
# Every object also depends on the headers it includes, as the compiler lists
# them (-MMD: DIR/x.d beside DIR/x.o), and on this Makefile (its flags).
# -I.: every file includes "zero2.h" and "runtime/..." from the top folder.
DEPFLAGS = -MMD -MP -MF $(@:.o=).d
-include $(shell find build build-cpu build-sanitize build-lab -name '*.d' 2>/dev/null)
# The trainer embeds data/corpus.txt as a C++ raw string (DIR/corpus.inc,
# which trainer/embedded_corpus.cpp alone includes), so `make run` needs no
# download and no file at run time.
CORPUS_INC = { printf 'R"corpus('; cat $<; printf ')corpus"\n'; } > $@

ifneq ($(NVCC),)
BUILD_KIND := nvcc
else
BUILD_KIND := cpu
endif

.PHONY: all cpu run verify golden lab labs demo bench bench-host-adam check-trace check-peer build-time math-accuracy fraglab plan paper-tables superlinear test test-all test-cpu sanitize notes figures deps test-deps figure-deps sanitize-deps hf-venv found clean
all: found build/test_zero2 build/demo_stages build/train_bert_mini build/convert_tool build/watchdog_check \
     build/sim_check
cpu: found build-cpu/test_zero2 build-cpu/demo_stages build-cpu/train_bert_mini build-cpu/convert_tool \
     build-cpu/watchdog_check build-cpu/sim_check

# What the build found; `make cpu` says it ignores nvcc.
cpu: BUILD_KIND = cpu (make cpu: nvcc not used)
found:
	@echo "zero2 build: $(BUILD_KIND)"
	@echo "  nvcc:     $(if $(NVCC),$(NVCC),not found (cpu-only build))"
	@echo "  NCCL:     $(if $(filter yes,$(HAVE_NCCL)),$(CUDA_HOME) (linked),not found (--comm nccl unavailable))"
	@echo "  MPI:      $$(command -v $(MPICXX) >/dev/null && echo "$(MPICXX), $$(mpichversion 2>/dev/null | head -n 1 | tr -s ' \t' ' ')" || echo 'not found: make deps')"
	@echo "  doctest:  $$(test -f /usr/include/doctest/doctest.h && echo /usr/include/doctest || echo 'not found: make deps')"
	@echo "  OpenBLAS: $$(ls /usr/lib/x86_64-linux-gnu/libopenblas.so 2>/dev/null || echo 'not found: make deps')"

# --- the default build (build/: nvcc when present) -------------------------------
# .cu files through nvcc; .cpp files through mpicxx, told that this build has
# CUDA (Z2_HAVE_CUDA: host code may call the CUDA runtime, cuBLAS and NCCL).
ifeq ($(BUILD_KIND),nvcc)
CUDA_CXXFLAGS := -DZ2_HAVE_CUDA -I$(CUDA_HOME)/include $(if $(filter yes,$(HAVE_NCCL)),-DZ2_HAVE_NCCL)
build/%.o: %.cu Makefile
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -DZ2_HAVE_CUDA $(DEPFLAGS) -I. -Ibuild -c $< -o $@
build/%.o: %.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(HOST_ONLY_FLAGS) $(CUDA_CXXFLAGS) $(DEPFLAGS) -I. -Ibuild -c $< -o $@
LIBS := $(CUDA_LIBS) $(HOST_LIBS)
else
build/%.o: %.cu Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) -I. -Ibuild -x c++ -c $< -o $@ -x none
build/%.o: %.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(HOST_ONLY_FLAGS) $(DEPFLAGS) -I. -Ibuild -c $< -o $@
LIBS := $(HOST_LIBS)
endif
build/test_zero2: $(call objects,build,$(TEST_SOURCES) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS) $(TRAINER_LIBS)
build/demo_stages: $(call objects,build,demos/demo_stages.cpp tests/mlp_model.cu $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS)
build/train_bert_mini: $(call objects,build,$(MODEL_SOURCE) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS) $(TRAINER_LIBS)
# For notes/08 and notes/10 (make notes runs both): the 16-bit reduction's error
# against DeepSpeed's, and the paper's Tables 1 and 2 from the ledger's formula.
build/reduce_precision: $(call objects,build,measurements/reduce_precision.cu trainer/embedded_corpus.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS)
build/paper_table: $(call objects,build,measurements/paper_table.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS)
# A desynchronized program, for the watchdog's roll call (tests/cli/reliability.sh).
build/watchdog_check: $(call objects,build,tests/watchdog_check.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS)
# The simulated device's rules, one small stream program per case (tests/cli/sim_device.sh).
build/sim_check: $(call objects,build,tests/sim_check.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(LIBS)
# exp / log / erf of zero2.h against libm's double functions, over every float
# (make math-accuracy; notes/07 shows its table). Header-only: no engine object.
build/math_accuracy: measurements/math_accuracy.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) -I. $< -o $@ -lpthread
# In which order this MPI adds the ranks' contributions (notes/06; make notes). Header-only.
build/mpi_sum_order: measurements/mpi_sum_order.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) -I. $< -o $@
# The 16-bit conversions as a filter, for tests/convert_check.py (torch's rounding).
build/convert_tool: tests/convert_tool.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) $< -o $@
build/corpus.inc: data/corpus.txt
	@mkdir -p $(@D)
	$(CORPUS_INC)
build/trainer/embedded_corpus.o: build/corpus.inc

# --- the cpu-only build (build-cpu/): .cu files compiled as C++ -----------------
# -x c++ makes g++ read a .cu file as C++ (it would take it for a linker
# script); -x none stops that from applying to the objects that follow.
build-cpu/%.o: %.cu Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) -I. -Ibuild-cpu -x c++ -c $< -o $@ -x none
build-cpu/%.o: %.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(HOST_ONLY_FLAGS) $(DEPFLAGS) -I. -Ibuild-cpu -c $< -o $@
build-cpu/test_zero2: $(call objects,build-cpu,$(TEST_SOURCES) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS) $(TRAINER_LIBS)
build-cpu/demo_stages: $(call objects,build-cpu,demos/demo_stages.cpp tests/mlp_model.cu $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS)
build-cpu/train_bert_mini: $(call objects,build-cpu,$(MODEL_SOURCE) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS) $(TRAINER_LIBS)
build-cpu/watchdog_check: $(call objects,build-cpu,tests/watchdog_check.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS)
build-cpu/sim_check: $(call objects,build-cpu,tests/sim_check.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS)
# ZeRO-Offload's host AdamW alone, beside DeepSpeedCPUAdam (make bench-host-adam; measurements/host_adam.sh).
build-cpu/host_adam_bench: $(call objects,build-cpu,measurements/host_adam_bench.cpp $(ENGINE_SOURCES))
	$(MPICXX) $^ -o $@ $(HOST_LIBS)
build-cpu/convert_tool: tests/convert_tool.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) $(DEPFLAGS) $< -o $@
build-cpu/corpus.inc: data/corpus.txt
	@mkdir -p $(@D)
	$(CORPUS_INC)
build-cpu/trainer/embedded_corpus.o: build-cpu/corpus.inc

# --- the course labs (notes/labs) ----------------------------------------------------
# The chapter, zero2.cu, compiled with its lab seams weak (-DZ2_LAB_BUILD,
# zero2.h's "lab seams"): a student's definition linked beside it replaces the
# engine's. Everything else is build-cpu's objects, so a lab builds in seconds
# after `make cpu`, and there is no copy of the engine per lab.
# runtime/lab_checks.cpp (a student's seams checked at build()) only a lab build calls.
LAB_OBJECTS := $(call objects,build-cpu,$(TEST_SOURCES) $(filter-out zero2.cu,$(ENGINE_SOURCES)) runtime/lab_checks.cpp \
                                      $(TRAINER_SOURCES))
build-lab/zero2.o: zero2.cu Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(CXXFLAGS) -DZ2_LAB_BUILD $(DEPFLAGS) -I. -x c++ -c $< -o $@ -x none
LAB_ENV = MPICXX="$(MPICXX)" CXXFLAGS="$(CXXFLAGS)" LAB_OBJECTS="$(LAB_OBJECTS)" $(RUN_ENV)

# --- the sanitized cpu build (build-sanitize/): ASan + UBSan ----------------------
# -O1 keeps the runs short; an UBSan finding stops the program (no recover),
# as an ASan one does. -g1: line tables only, all a sanitizer's stack trace
# needs (full -g made these compiles a third slower). The same .cu files,
# compiled as C++.
SANITIZE_FLAGS := -std=c++17 -O1 -g1 -fno-omit-frame-pointer -ffp-contract=off -fopenmp -fsanitize=address,undefined \
                  -fno-sanitize-recover=undefined -Wall -Wextra -Wno-unused-parameter
build-sanitize/%.o: %.cu Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(SANITIZE_FLAGS) $(DEPFLAGS) -I. -Ibuild-sanitize -x c++ -c $< -o $@ -x none
build-sanitize/%.o: %.cpp Makefile
	@mkdir -p $(@D)
	$(MPICXX) $(SANITIZE_FLAGS) $(DEPFLAGS) -I. -Ibuild-sanitize -c $< -o $@
build-sanitize/test_zero2: $(call objects,build-sanitize,$(TEST_SOURCES) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) -fsanitize=address,undefined $^ -o $@ $(HOST_LIBS) $(TRAINER_LIBS)
build-sanitize/train_bert_mini: $(call objects,build-sanitize,$(MODEL_SOURCE) $(ENGINE_SOURCES) $(TRAINER_SOURCES))
	$(MPICXX) -fsanitize=address,undefined $^ -o $@ $(HOST_LIBS) $(TRAINER_LIBS)
build-sanitize/corpus.inc: data/corpus.txt
	@mkdir -p $(@D)
	$(CORPUS_INC)
build-sanitize/trainer/embedded_corpus.o: build-sanitize/corpus.inc
# The safetensors fuzz target (tests/fuzz_safetensors.cpp): clang++ through
# mpicxx (MPICH_CXX), as libFuzzer is clang's. Coverage (-fsanitize=fuzzer)
# on the target and the parser's files only. The parser's file also maps a
# file through InputFile (trainer/inputs.cpp), whose file holds
# check_same_inputs and what that calls (MPI, the checkpoints, the config
# reader): inputs.cpp is compiled without coverage, each function in its
# own section, and --gc-sections drops those the target never reaches, so
# the rest of the trainer need not be linked (coverage would keep them all).
# (-Wno-unknown-pragmas: runtime/compute.h's `#pragma GCC ivdep` is g++'s.)
FUZZ_CXX     := MPICH_CXX=clang++-14 $(MPICXX)
FUZZ_FLAGS   := -std=c++17 -O1 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
                -ffunction-sections -fdata-sections -Wall -Wextra -Wno-unused-parameter -Wno-unknown-pragmas
FUZZ_COVERED := tests/fuzz_safetensors.cpp trainer/safetensors.cpp trainer/json.cpp
FUZZ_LINKED  := trainer/inputs.cpp runtime/errors.cpp
build-sanitize/fuzz/%.o: %.cpp Makefile
	@mkdir -p $(@D)
	$(FUZZ_CXX) $(FUZZ_FLAGS) $(if $(filter $<,$(FUZZ_COVERED)),-fsanitize=fuzzer-no-link) $(DEPFLAGS) -I. -c $< -o $@
build-sanitize/fuzz_safetensors: $(call objects,build-sanitize/fuzz,$(FUZZ_COVERED) $(FUZZ_LINKED))
	$(FUZZ_CXX) -fsanitize=fuzzer,address,undefined -Wl,--gc-sections $^ -o $@

# --- running --------------------------------------------------------------------
# One OpenBLAS thread per rank: ranks already fill the cores, and OpenBLAS
# starts its own threads regardless of OpenMP settings.
RUN_ENV := OPENBLAS_NUM_THREADS=1

# BERT-mini, stage 2, 2 ranks, on the embedded corpus (GPUs when present).
# Only the trainer is built here, its two objects side by side (-j2), so a
# first `make run` starts training in about a minute.
run: deps found
	@$(MAKE) --no-print-directory -j2 build/train_bert_mini
	$(RUN_ENV) timeout 600 mpirun -n 2 build/train_bert_mini --stage 2

VERIFY_BUILD ?= build
verify: deps
	@$(MAKE) --no-print-directory -j2 $(VERIFY_BUILD)/train_bert_mini
	tests/verify.sh $(VERIFY_BUILD)

golden: deps all
	tests/verify.sh build --write

demo: deps all
	$(RUN_ENV) timeout 300 mpirun -n 2 build/demo_stages

bench: deps test-deps all cpu build-cpu/host_adam_bench
	$(RUN_ENV) measurements/bench.sh build build-cpu
	$(RUN_ENV) measurements/host_adam.sh build-cpu

bench-host-adam: deps found build-cpu/host_adam_bench build-cpu/train_bert_mini
	$(RUN_ENV) measurements/host_adam.sh build-cpu

# How long a fresh clone's `make -j2 build/train_bert_mini` takes at BASE and at
# HEAD, built alternately (measurements/build_time.sh): make build-time BASE=6c9a223
build-time: deps found
	measurements/build_time.sh $(if $(BASE),$(BASE),HEAD~1) $(if $(ROUNDS),$(ROUNDS),3)

# Every float through exp_fp32, log_fp32 and erf_fp32 (a few minutes on 2 cores).
math-accuracy: deps found build/math_accuracy
	build/math_accuracy

# Only the trainer is needed, built as `make run` builds it.
fraglab: deps found
	@$(MAKE) --no-print-directory -j2 build/train_bert_mini
	$(RUN_ENV) demos/fraglab.sh build

plan: deps found
	@$(MAKE) --no-print-directory -j2 build/train_bert_mini
	build/train_bert_mini --plan

paper-tables: deps found build/paper_table
	build/paper_table

superlinear: deps found
	@$(MAKE) --no-print-directory -j2 build/train_bert_mini
	$(RUN_ENV) demos/superlinear.sh build

# The README's test command: the quick suite (Z2_QUICK=1: each file's `quick` checks). ONLY= (from the
# command line, through the environment) picks parts of the suite, here and in test-all.
test: deps test-deps hf-venv all
	$(RUN_ENV) Z2_QUICK=1 tests/run_tests.sh build

# Everything (Z2_ALL=1): the suite whole, then test-cpu, labs, sanitize and check-peer, each as
# its target runs it, summed into one line; what CI runs after its builds.
test-all: deps test-deps hf-venv all
	$(RUN_ENV) Z2_ALL=1 tests/run_tests.sh build

# The mpicxx-only build computes with the same sources as build/ without a GPU, but compiled by g++
# instead of nvcc (the .cu files: the chapter, the gemms, the model) and without Z2_HAVE_CUDA (the
# allocators, the communicator): what it must prove is that it computes the same bits. The doctest
# suite once at N = 2 (the engine's matrices, checkpoints and offload in process), and the quick checks of
# the capabilities that compute bits: the stage matrix, ZeRO-R (the allocators), the 16-bit precisions,
# and portable mode (the golden table's small rows, `make verify VERIFY_BUILD=build-cpu`). The trainer's
# plumbing (trainer/*.cpp: writers, inputs, configs, plan, traces) is one compile of one source in both
# builds, which `make test` and `make test-all` check.
TEST_CPU_ONLY := doctest stages zero_r precision portable
test-cpu: deps test-deps cpu
	$(RUN_ENV) Z2_QUICK=1 Z2_DOCTEST_RANKS=2 ONLY="$(TEST_CPU_ONLY)" tests/run_tests.sh build-cpu

# Checking another implementation against zero2 (notes/12). The checker needs numpy alone; the torch
# peer Debian's torch and the Hugging Face venv (hf-venv); the DeepSpeed peer a venv of its own, which
# tests/peers/check_peer.sh makes (.venv-deepspeed). REF and THEIRS reach the recipe's shell through
# the environment (make exports the variables of its command line) and are quoted there: a path with a
# space or a quote stays one argument, and is never read as shell syntax. CHECK_FLAGS (e.g. --margins,
# --twin DIR) are added as words.
check-trace:
	@[ -n "$$REF" ] && [ -n "$$THEIRS" ] || { echo "usage: make check-trace REF=zero2's-trace THEIRS=your-trace"; exit 2; }
	/usr/bin/python3 tests/check_trace.py "$$REF" "$$THEIRS" $$CHECK_FLAGS

check-peer: deps test-deps $(if $(filter fsdp,$(PEER)),,hf-venv)
	@$(MAKE) --no-print-directory -j2 build/train_bert_mini
	tests/peers/check_peer.sh $(if $(PEER),$(PEER),torch) build

sanitize: deps sanitize-deps found build-sanitize/test_zero2 build-sanitize/train_bert_mini build-sanitize/fuzz_safetensors
	$(RUN_ENV) tests/sanitize.sh build-sanitize

# The torch-step lab (Python) grades a replay of build-cpu's trainer's trace in the Hugging Face venv.
lab: deps build-lab/zero2.o $(LAB_OBJECTS) build-cpu/train_bert_mini hf-venv
	@$(LAB_ENV) tests/lab.sh $(if $(LAB),$(LAB),--list) $(SOLUTION)

labs: deps build-lab/zero2.o $(LAB_OBJECTS) build-cpu/train_bert_mini hf-venv
	$(LAB_ENV) tests/lab.sh --all

notes: deps test-deps all cpu build-cpu/host_adam_bench build-lab/zero2.o $(LAB_OBJECTS) build/reduce_precision build/paper_table build/math_accuracy \
       build/mpi_sum_order
	$(RUN_ENV) notes/generate.sh build

figures: deps figure-deps all
	$(RUN_ENV) notes/figures.sh build

test-deps: PACKAGES = $(TEST_PACKAGES)
figure-deps: PACKAGES = $(FIGURE_PACKAGES)
sanitize-deps: PACKAGES = $(SANITIZE_PACKAGES)
deps test-deps figure-deps sanitize-deps:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "missing Debian packages:$$missing"; echo "install them with:  sudo apt-get install -y$$missing"; exit 1; \
	fi

hf-venv:
	@if $(HF_VENV)/bin/python -c 'import transformers, tokenizers' 2>/dev/null; then exit 0; fi; \
	rm -rf $(HF_VENV); \
	if /usr/bin/python3 -m venv --system-site-packages $(HF_VENV) >$(HF_VENV).log 2>&1 && \
	   timeout 600 $(HF_VENV)/bin/pip install -q --disable-pip-version-check $(HF_PACKAGES) >>$(HF_VENV).log 2>&1; then \
	  echo "made $(HF_VENV): $(HF_PACKAGES)"; \
	else \
	  echo "could not make $(HF_VENV) ($$(tail -n 1 $(HF_VENV).log)): the Hugging Face round trip will say SKIP"; \
	  rm -rf $(HF_VENV); \
	fi

clean:
	rm -rf build build-cpu build-sanitize build-lab
