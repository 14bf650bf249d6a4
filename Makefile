# zero2 — build, test and run.
#
#   make          build with nvcc if it is on PATH or in /usr/local/cuda (cpu + cuda
#                 compute, mpi + nccl communication), else with mpicxx alone (cpu + mpi)
#   make cpu      force the mpicxx-only build (into build-cpu/)
#   make run      the demo: the three stages on the test model, 2 ranks
#   make test     the doctest suite under mpirun -n 1, 2, 4 (build/)
#   make test-cpu the same suite for the mpicxx-only build (build-cpu/)
#   make notes    regenerate the measured tables in notes/
#   make deps     install missing Debian packages (as root), or print the command
#
# Every flag that matters is below; nothing is hidden in a script.

# --- what we need from Debian -------------------------------------------------
PACKAGES := mpich libmpich-dev doctest-dev libopenblas-dev nlohmann-json3-dev

# --- tools --------------------------------------------------------------------
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
MPICXX    ?= mpicxx
# NCCL sits in the CUDA directory with no dpkg entry: ask the compiler.
HASH      := \#
HAVE_NCCL := $(shell printf '$(HASH)include <nccl.h>\nint main(){int v;return ncclGetVersion(&v);}\n' | \
               g++ -x c++ - -I$(CUDA_HOME)/include -L$(CUDA_HOME)/lib64 -lnccl -o /dev/null 2>/dev/null && echo yes)

# --- flags --------------------------------------------------------------------
# -O2, no -ffast-math: the determinism contract needs IEEE float semantics
# (fast-math would let the compiler reassociate our fixed summation order).
# No contraction of a * b + c into one fused multiply-add either: the canonical
# tree is defined on rounded products (a norm chunk sums rounded squares), and
# with -ffp-contract=off (g++) and -fmad=false (nvcc) the CPU loop and the CUDA
# kernel round the same way.
CXXFLAGS  := -std=c++17 -O2 -g -ffp-contract=off -Wall -Wextra -Wno-unused-parameter
# nvcc uses mpicxx as its host compiler, so MPI's include and link flags come
# along without nvcc having to parse them (it rejects some, e.g. -Wl,-z,relro).
# --extended-lambda lets a Z2_HD lambda be a kernel body; sm_80 (A100) and
# sm_90 (H100/H200) machine code, plus compute_90 PTX for newer GPUs.
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]
NVCCFLAGS := -std=c++17 -O2 -g -ccbin $(MPICXX) --extended-lambda --expt-relaxed-constexpr $(CUDA_ARCH) \
             -fmad=false -Xcompiler -Wall,-Wno-unused-parameter,-ffp-contract=off
BLAS_LIBS := -lopenblas
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart
ifeq ($(HAVE_NCCL),yes)
NVCCFLAGS += -DZ2_HAVE_NCCL
CUDA_LIBS += -lnccl
endif

# --- what gets built ------------------------------------------------------------
ENGINE  := zero2.cu zero2.h Makefile
MODEL   := tests/mlp_model.h
TESTS   := tests/test_main.cpp tests/test_collectives.cpp tests/test_engine.cpp
TEST_H  := tests/harness.h tests/mlp_model.h zero2.h Makefile

ifneq ($(NVCC),)
BUILD_KIND := nvcc
else
BUILD_KIND := cpu
endif

.PHONY: all cpu run test test-cpu notes deps found clean
all: found build/test_zero2 build/demo_stages
cpu: found build-cpu/test_zero2 build-cpu/demo_stages

# What the build found; `make cpu` says it ignores nvcc.
cpu: BUILD_KIND = cpu (make cpu: nvcc not used)
found:
	@echo "zero2 build: $(BUILD_KIND)"
	@echo "  nvcc:     $(if $(NVCC),$(NVCC),not found (cpu-only build))"
	@echo "  NCCL:     $(if $(filter yes,$(HAVE_NCCL)),$(CUDA_HOME) (linked),not found (--comm nccl unavailable))"
	@echo "  MPI:      $$(command -v $(MPICXX) >/dev/null && echo "$(MPICXX), $$(mpichversion 2>/dev/null | head -n 1 | tr -s ' \t' ' ')" || echo 'not found: make deps')"
	@echo "  doctest:  $$(test -f /usr/include/doctest/doctest.h && echo /usr/include/doctest || echo 'not found: make deps')"
	@echo "  OpenBLAS: $$(ls /usr/lib/x86_64-linux-gnu/libopenblas.so 2>/dev/null || echo 'not found: make deps')"

# --- the default build (nvcc when present) --------------------------------------
ifeq ($(BUILD_KIND),nvcc)
build/%.o: %.cu $(ENGINE) $(MODEL) | build/tests
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
build/test_zero2 build/demo_stages: LIBS = $(CUDA_LIBS) $(BLAS_LIBS)
else
build/%.o: %.cu $(ENGINE) $(MODEL) | build/tests
	$(MPICXX) $(CXXFLAGS) -x c++ -c $< -o $@
build/test_zero2 build/demo_stages: LIBS = $(BLAS_LIBS)
endif
build/tests/%.o: tests/%.cpp $(TEST_H) | build/tests
	$(MPICXX) $(CXXFLAGS) -c $< -o $@
build/test_zero2: build/zero2.o build/tests/mlp_model.o $(TESTS:tests/%.cpp=build/tests/%.o)
	$(MPICXX) $^ -o $@ $(LIBS)
build/demo_stages: build/zero2.o build/tests/mlp_model.o build/tests/demo_stages.o
	$(MPICXX) $^ -o $@ $(LIBS)
build/tests:
	mkdir -p $@

# --- the cpu-only build: .cu files compiled as C++ ----------------------------
# -x c++ makes g++ read a .cu file as C++ (it would take it for a linker
# script); -x none stops that from applying to the objects that follow.
build-cpu/%.o: %.cu $(ENGINE) $(MODEL) | build-cpu/tests
	$(MPICXX) $(CXXFLAGS) -x c++ -c $< -o $@ -x none
build-cpu/tests/%.o: tests/%.cpp $(TEST_H) | build-cpu/tests
	$(MPICXX) $(CXXFLAGS) -c $< -o $@
build-cpu/test_zero2: build-cpu/zero2.o build-cpu/tests/mlp_model.o $(TESTS:tests/%.cpp=build-cpu/tests/%.o)
	$(MPICXX) $^ -o $@ $(BLAS_LIBS)
build-cpu/demo_stages: build-cpu/zero2.o build-cpu/tests/mlp_model.o build-cpu/tests/demo_stages.o
	$(MPICXX) $^ -o $@ $(BLAS_LIBS)
build-cpu/tests:
	mkdir -p $@

# --- running --------------------------------------------------------------------
# One OpenBLAS thread per rank: ranks already fill the cores, and OpenBLAS
# starts its own threads regardless of OpenMP settings.
RUN_ENV := OPENBLAS_NUM_THREADS=1

run: deps all
	$(RUN_ENV) timeout 300 mpirun -n 2 build/demo_stages

test: deps all
	$(RUN_ENV) tests/run_tests.sh build

test-cpu: deps cpu
	$(RUN_ENV) tests/run_tests.sh build-cpu

notes: deps all
	$(RUN_ENV) notes/generate.sh build

deps:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	  echo "missing Debian packages:$$missing"; echo "install them with:  sudo apt-get install -y$$missing"; exit 1; \
	fi

clean:
	rm -rf build build-cpu
