# The README's two commands, `make demo` and `make test`, set up everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
DEPS := $(VENV)/.deps-installed
EXT := build/.extension-installed
SOURCES := $(wildcard csrc/*.c csrc/*.h) setup.py
TEST_JOBS ?=

.PHONY: all build fakes demo test verify sanitize bench bench-quick clean

all: build

$(DEPS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 pytest numpy matplotlib setuptools wheel
	# libnccl.so.2 and nccl.h, for the NCCL loader and ABI tests (no GPU needed).
	$(PY) -m pip install --quiet nvidia-nccl-cu13==2.30.7
	# megatron-core, for the drop-in tests only. Its wheel says Python >= 3.12 but runs on 3.11; of its
	# dependencies the import needs torch, numpy, packaging, and triton (schedules imports it at module level).
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PY) -m pip install --quiet --no-deps packaging triton==3.9.0
	# The source tree itself is the package (a .pth entry), so torchrun workers import it too.
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron_p2p_source.pth"
	touch $@

# Built in build/ and then moved into place with a new inode, so ranks still running the old
# library are not disturbed.
$(EXT): $(DEPS) $(SOURCES)
	$(PY) setup.py --quiet build_ext --build-temp build/temp --build-lib build/lib
	for so in build/lib/megatron_p2p/_C*.so; do install -m 755 "$$so" megatron_p2p/; done
	touch $@

build: $(EXT)

# A model of libcuda and libnccl (tests/fakes/) that runs the NCCL backend on CPU in the tests;
# the package never loads it by itself (MEGATRON_P2P_CUDA_LIBRARY / _NCCL_LIBRARY point at it).
FAKES := build/fakes/libcuda.so.1 build/fakes/libnccl.so.2
FAKE_CFLAGS := -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -pthread

fakes: $(FAKES)

build/fakes/libcuda.so.1: tests/fakes/libcuda.c tests/fakes/mpfake.h
	mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -Wl,-soname,libcuda.so.1 -o $@ $<

# Linked against the fake driver next to it ($$ORIGIN), so that both loaders get one copy.
build/fakes/libnccl.so.2: tests/fakes/libnccl.c tests/fakes/mpfake.h build/fakes/libcuda.so.1
	$(CC) $(FAKE_CFLAGS) -Wl,-soname,libnccl.so.2 -o $@ $< -Lbuild/fakes -l:libcuda.so.1 '-Wl,-rpath,$$ORIGIN' -lrt

demo: build
	$(TORCHRUN) --standalone --nproc-per-node 4 -m megatron_p2p.demo

test: build fakes
	$(PY) -m pytest -q $(TEST_JOBS)

# Deadlock freedom, the long way: 1000 random programs through the checker (each against an
# exhaustive search where small enough), 100 of them replayed on the shm transport, and the full
# grid of megatron-core's schedules (pp 1-64), under 10 minutes of it on 2 cores.
verify: build fakes
	MEGATRON_P2P_VERIFY_PROGRAMS=1000 MEGATRON_P2P_VERIFY_REPLAYS=100 $(PY) -m pytest -q tests/test_check.py tests/test_replay.py
	$(PY) -m megatron_p2p.check --grid

# The extension built with AddressSanitizer and UndefinedBehaviorSanitizer, and the whole suite
# run against it (every torchrun rank inherits the preloaded runtime).
# libstdc++ is preloaded with it: C++ extensions (matplotlib's) throw, and ASan's __cxa_throw
# interceptor needs the real one loaded before it.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libstdc++.so.6)
sanitize: $(DEPS) fakes
	MEGATRON_P2P_SANITIZE=1 $(PY) setup.py --quiet build_ext --build-temp build/asan-temp --build-lib build/asan
	cp megatron_p2p/*.py build/asan/megatron_p2p/
	cp -r megatron_p2p/programs build/asan/megatron_p2p/
	# From build/asan, so that `python -m` (which puts the working directory first on the path)
	# imports the instrumented copy; tests/test_build.py checks that it did.
	cd build/asan && PYTHONPATH=$(CURDIR)/build/asan LD_PRELOAD="$(ASAN_LIB)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	MEGATRON_P2P_EXPECT_SANITIZED=1 $(CURDIR)/$(PY) -m pytest -q -x -p no:cacheprovider $(CURDIR)/tests

# The benchmark suite (benchmarks/run.py): torchrun jobs with wall-clock limits, then one JSON,
# PNG plots, a table and a goal line per goal. `bench` also rewrites benchmarks/RESULTS.md.
bench: build
	$(PY) benchmarks/run.py --results-md benchmarks/RESULTS.md

bench-quick: build
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf build megatron_p2p/*.so
