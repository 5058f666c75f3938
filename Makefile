# The README's two commands, `make demo` and `make test`, set up everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
BASE := $(VENV)/.base-installed
DEPS := $(VENV)/.deps-installed
EXT := build/.extension-installed
SOURCES := $(wildcard csrc/*/*.c csrc/*/*.h) setup.py
# The suite runs on 2 pytest workers, each taking whole files (module fixtures run once): most of its
# time is torchrun jobs starting up and waiting, which two at a time fill the 2 cores with.
TEST_WORKERS ?= 2
TEST_JOBS ?= -n $(TEST_WORKERS) --dist loadfile

.PHONY: all build docs fakes gpu-carry demo test test-fast test-torch-latest test-stress verify soak fuzz sanitize lint tsan bench bench-quick clean

all: build

# What `make demo` needs, and all a user's environment needs: torch (TORCH_INDEX=URL picks the
# index it comes from, such as PyTorch's CPU-only one) and the build tools. The source tree itself
# is the package (a .pth entry), so torchrun workers import it too.
TORCH_INDEX ?=
$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install --quiet setuptools wheel
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron_p2p_source.pth"
	touch $@

# What the tests add.
$(DEPS): $(BASE)
	$(PY) -m pip install --quiet pytest pytest-xdist==3.8.0 numpy matplotlib
	# strace, for the test that no rank grants ptrace access beyond its peers (tests/test_security.py),
	# where this user may install it; without it that test skips and says why.
	command -v strace >/dev/null || (apt-get update && apt-get install -y strace) >/dev/null 2>&1 || \
		echo "strace not installed: tests/test_security.py skips its prctl trace"
	# The argument-layer property tests and the fuzz targets (tests/fuzz/).
	$(PY) -m pip install --quiet hypothesis==6.170.17 atheris==3.0.0
	# libnccl.so.2 and nccl.h, for the NCCL loader and ABI tests (no GPU needed).
	$(PY) -m pip install --quiet nvidia-nccl-cu13==2.30.7
	# megatron-core, for the drop-in tests only. Its wheel says Python >= 3.12 but runs on 3.11; of its
	# dependencies the import needs torch, numpy, packaging, and triton (schedules imports it at module level).
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PY) -m pip install --quiet --no-deps packaging triton==3.9.0
	touch $@

# Built in build/ and then moved into place with a new inode, so ranks still running the old
# library are not disturbed.
$(EXT): $(BASE) $(SOURCES)
	$(PY) setup.py --quiet build_ext --build-temp build/temp --build-lib build/lib
	for so in build/lib/megatron_p2p/_C*.so; do install -m 755 "$$so" megatron_p2p/; done
	touch $@

# megatron_p2p._testing, the hooks only the tests and benchmarks use (MEGATRON_P2P_TESTING adds it
# to setup.py's extensions; a plain `pip install .` builds _C alone).
TESTING := build/.testing-installed
$(TESTING): $(EXT) $(DEPS)
	MEGATRON_P2P_TESTING=1 $(PY) setup.py --quiet build_ext --build-temp build/temp --build-lib build/lib
	for so in build/lib/megatron_p2p/_testing*.so; do install -m 755 "$$so" megatron_p2p/; done
	touch $@

build: $(EXT)

# A model of libcuda and libnccl (tests/fakes/) that runs the NCCL backend on CPU in the tests;
# each built beside and moved into place (a new inode), so that running ranks keep the old one;
# the package never loads it by itself (MEGATRON_P2P_CUDA_LIBRARY / _NCCL_LIBRARY point at it).
FAKES := build/fakes/libcuda.so.1 build/fakes/libnccl.so.2
FAKE_CFLAGS := -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -pthread

fakes: $(FAKES)

build/fakes/libcuda.so.1: tests/fakes/libcuda.c tests/fakes/mpfake.h
	mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -Wl,-soname,libcuda.so.1 -o $@.tmp $< && mv $@.tmp $@

# Linked against the fake driver next to it ($$ORIGIN), so that both loaders get one copy; only
# NCCL's API and the model's counters are exported (nccl_model.h: API).
NCCL_MODEL := tests/fakes/libnccl.c tests/fakes/nccl_kernels.c tests/fakes/nccl_groups.c tests/fakes/nccl_rma.c
build/fakes/libnccl.so.2: $(NCCL_MODEL) tests/fakes/nccl_model.h tests/fakes/mpfake.h build/fakes/libcuda.so.1
	$(CC) $(FAKE_CFLAGS) -fvisibility=hidden -Wl,-soname,libnccl.so.2 -o $@.tmp $(NCCL_MODEL) -Lbuild/fakes -l:libcuda.so.1 \
		'-Wl,-rpath,$$ORIGIN' -lrt && mv $@.tmp $@

# What tests/gpu/run_device_checks.sh takes beside the tree to a GPU machine, which reaches no
# package index: megatron-core (pure Python) for the schedule checks, in build/gpu-site; with
# NCCL_LIB=FILE, an NCCL 2.30.7 libnccl.so.2 already built (tests/gpu/build_nccl.sh builds one from
# NVIDIA/nccl's source), checked and copied to build/nccl. Carry build/gpu-site, build/nccl and
# build/device-dry-run (the dry run `make test` leaves).
gpu-carry: $(DEPS)
	rm -rf build/gpu-site
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python --target build/gpu-site megatron-core==0.19.2 packaging
	find build/gpu-site -name __pycache__ -prune -exec rm -rf {} +
	if [ -n "$(NCCL_LIB)" ]; then tests/gpu/build_nccl.sh --check "$(NCCL_LIB)" && mkdir -p build/nccl && \
	  install -m 755 "$(NCCL_LIB)" build/nccl/libnccl.so.2; fi

# The generated part of the docs: the environment variables' table (megatron_p2p/_env.py).
docs: $(EXT)
	$(PY) -c 'from megatron_p2p._env import write_docs; write_docs("docs/environment.md")'

demo: build
	$(TORCHRUN) --standalone --nproc-per-node 4 -m megatron_p2p.demo

test: $(TESTING) fakes
	$(PY) -m pytest -q $(TEST_JOBS)

# The edit-test loop: every test that launches no torchrun job (tests/conftest.py marks those), in
# under 2 minutes; run_job refuses to launch here, so a test the mark misses fails instead.
test-fast: $(TESTING) fakes
	MEGATRON_P2P_FAST_TESTS=1 $(PY) -m pytest -q -m "not torchrun" $(TEST_JOBS)

# The torch-facing tests (the torch-style ops, torch.distributed.pipelining, the megatron-core
# drop-in and its CPU shim) against the newest torch on PyPI, in a virtual environment of its own:
# a CUDA build (about 5.5 GB with its dependencies), which runs them on the CPU where there is no GPU.
LATEST := .venv-torch-latest
LATEST_TESTS := tests/test_pipelining.py tests/test_torch_schedules.py tests/test_patching.py \
	tests/test_megatron_dropin.py tests/test_megatron_on_cpu.py tests/test_examples.py tests/test_fuzz_arguments.py \
	tests/test_packaging.py
test-torch-latest: $(TESTING) fakes
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade torch
	$(LATEST)/bin/python -m pip install --quiet pytest pytest-xdist==3.8.0 numpy hypothesis==6.170.17
	$(LATEST)/bin/python -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	$(LATEST)/bin/python -m pip install --quiet --no-deps packaging
	echo "$(CURDIR)" > "$$($(LATEST)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron_p2p_source.pth"
	$(LATEST)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider $(TEST_JOBS) $(LATEST_TESTS)

# The timing-sensitive tests (tests/stress.py lists them), STRESS_ROUNDS times, beside one
# CPU-bound process per core: a test that assumes a timing fails here before CI meets it.
# Not part of `make test`; about 12 minutes a round on 2 cores.
STRESS_ROUNDS ?= 3
test-stress: $(TESTING) fakes
	$(PY) tests/stress.py --rounds $(STRESS_ROUNDS)

# Deadlock freedom, the long way: 1000 random programs through the checker (each against an
# exhaustive search where small enough), 100 of them replayed on the shm transport, and the full
# grid of megatron-core's schedules (pp 1-64) and torch.distributed.pipelining's (pp 2-32), and
# megatron-core's again with each rank's lanes serialized in issue order (the worst case NCCL's
# launch order allows; torch's programs post on one lane).
verify: $(TESTING) fakes
	MEGATRON_P2P_VERIFY_PROGRAMS=1000 MEGATRON_P2P_VERIFY_REPLAYS=100 $(PY) -m pytest -q tests/test_check.py tests/test_replay.py
	$(PY) -m megatron_p2p.check --grid
	$(PY) -m megatron_p2p.check --grid --serialize-lanes --family megatron

# The soak, long (tests/test_soak.py; `make test` runs a short one): 100,000 exchanges of random
# sizes, modes and lane counts on 3 ranks (an odd ring: prev and next differ), and 200
# communicators created and closed; memory, descriptors, threads and segments must stay flat.
# Prints its figures; about 5 minutes on 2 cores.
SOAK_RANKS ?= 3
soak: $(TESTING)
	MEGATRON_P2P_SOAK_EXCHANGES=100000 MEGATRON_P2P_SOAK_COMMUNICATORS=200 MEGATRON_P2P_SOAK_RANKS=$(SOAK_RANKS) \
	$(PY) -m pytest -q -s -p no:cacheprovider tests/test_soak.py

# atheris (libFuzzer) over the program-file parser and the exchange plan, FUZZ_SECONDS each, from
# the seed corpus in tests/fuzz/corpus/; what they add goes to build/fuzz/, crashes to build/fuzz/.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := program_file plan
fuzz: $(TESTING)
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/$$t && $(PY) tests/fuzz/fuzz_$$t.py -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=build/fuzz/$$t- build/fuzz/$$t tests/fuzz/corpus/$$t || exit 1; \
	done

# The extension built with AddressSanitizer and UndefinedBehaviorSanitizer, and the whole suite
# run against it (every torchrun rank inherits the preloaded runtime).
# libstdc++ is preloaded with it: C++ extensions (matplotlib's) throw, and ASan's __cxa_throw
# interceptor needs the real one loaded before it.
SANITIZE_TESTS ?= tests # or some of its files: make sanitize SANITIZE_TESTS="tests/test_matching.py"
ASAN_LIB = $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libstdc++.so.6)
sanitize: $(DEPS) fakes
	MEGATRON_P2P_SANITIZE=1 MEGATRON_P2P_TESTING=1 $(PY) setup.py --quiet build_ext --build-temp build/asan-temp --build-lib build/asan
	cp megatron_p2p/*.py build/asan/megatron_p2p/
	mkdir -p build/asan/megatron_p2p/verify && cp megatron_p2p/verify/*.py build/asan/megatron_p2p/verify/
	cp -r megatron_p2p/programs build/asan/megatron_p2p/
	# From build/asan, so that `python -m` (which puts the working directory first on the path)
	# imports the instrumented copy; tests/test_build.py checks that it did.
	cd build/asan && PYTHONPATH=$(CURDIR)/build/asan LD_PRELOAD="$(ASAN_LIB)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	MEGATRON_P2P_EXPECT_SANITIZED=1 $(CURDIR)/$(PY) -m pytest -q -x -p no:cacheprovider $(TEST_JOBS) \
	$(addprefix $(CURDIR)/,$(SANITIZE_TESTS))

# Static analysis, which fails on any finding: gcc's analyzer over every source with the
# extension's flags (and Python's headers, for the bindings), then cppcheck. cppcheck is
# installed when missing: CI runs as root on a fresh Debian machine.
LINT_CFLAGS := -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -O2 -fanalyzer
CPPCHECK_FLAGS := --quiet --std=c11 --library=posix --library=gnu --library=python --inline-suppr \
	--enable=warning,performance,portability --error-exitcode=1 -D_GNU_SOURCE -Icsrc
# Python: ruff (pyproject.toml's rules) over everything, mypy strict over the package (pyproject.toml)
# and over the tests with every body checked, annotations optional (tests/mypy.ini), stubtest.
LINT_DEPS := $(VENV)/.lint-installed
$(LINT_DEPS): $(DEPS)
	$(PY) -m pip install --quiet ruff==0.17.6 mypy==2.4.1
	touch $@

lint: $(LINT_DEPS) $(TESTING)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy megatron_p2p
	$(VENV)/bin/mypy --config-file tests/mypy.ini tests
	# the extension's stubs (_C.pyi, _testing.pyi) against the built modules
	$(PY) -m mypy.stubtest megatron_p2p._C megatron_p2p._testing
	command -v cppcheck >/dev/null || (apt-get update && apt-get install -y cppcheck)
	include="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" && \
	for src in csrc/*/*.c; do gcc $(LINT_CFLAGS) -Icsrc -I"$$include" -c $$src -o /dev/null || exit 1; done
	cppcheck $(CPPCHECK_FLAGS) csrc

# The shm engine without Python (tests/c/shm_engine_stress.c), under ThreadSanitizer: 4 ranks as
# processes, a posting thread per lane in each, rounds started for 60 s; any report fails it.
# STRESS_SEED=n draws another plan (the seed is printed).
# tests/test_shm_engine_c.py builds the plain one (any directory/shm_engine_stress) for `make test`.
# -Wno-tsan: TSAN does not model the seqlock's fences, which pair with readers in other processes
# that it cannot see anyway.
# The shm transport and the core it needs: no Python.
ENGINE_SOURCES := $(wildcard csrc/shm/*.c) $(addprefix csrc/core/,dtype.c result.c plan.c waitfor.c cycle_report.c shape.c)
ENGINE_CFLAGS := -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -g -Icsrc -pthread
ENGINE_PROGRAM = mkdir -p $(@D) && gcc $(ENGINE_CFLAGS) -O2 -o $@ $< $(ENGINE_SOURCES)
%/shm_engine_stress: tests/c/shm_engine_stress.c $(ENGINE_SOURCES) $(wildcard csrc/*/*.h)
	$(ENGINE_PROGRAM)

# tests/test_deadlock.py builds this one: a deadlock cycle's fencing held half-done on purpose.
%/shm_fence_order: tests/c/shm_fence_order.c $(ENGINE_SOURCES) $(wildcard csrc/*/*.h)
	$(ENGINE_PROGRAM)

# NCCL's one-sided API driven as a user drives it (tests/test_nccl_model_rma.py): linked to the
# model here, and to the real libraries by tests/gpu/run_device_checks.sh.
%/nccl_rma_check: tests/c/nccl_rma_check.c csrc/nccl/nccl_abi.h $(FAKES)
	mkdir -p $(@D)
	gcc -std=c11 -Wall -Wextra -Werror -g -Icsrc -o $@ $< -L$(CURDIR)/build/fakes -l:libnccl.so.2 -l:libcuda.so.1 \
		-Wl,-rpath,$(CURDIR)/build/fakes -ldl

build/tsan/shm_engine_stress_tsan: tests/c/shm_engine_stress.c $(ENGINE_SOURCES) $(wildcard csrc/*/*.h)
	mkdir -p $(@D)
	gcc $(ENGINE_CFLAGS) -O1 -fsanitize=thread -Wno-tsan -o $@ $< $(ENGINE_SOURCES)

STRESS_SEED ?= 1
tsan: build/tsan/shm_engine_stress_tsan
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 $< -r 4 -d 60 -n 1000000 -l 400 -s $(STRESS_SEED)

# The benchmark suite (benchmarks/run.py): torchrun jobs with wall-clock limits, then one JSON,
# PNG plots, a table and a goal line per goal. `bench` also rewrites benchmarks/RESULTS.md.
bench: $(TESTING)
	$(PY) benchmarks/run.py --results-md benchmarks/RESULTS.md

bench-quick: $(TESTING)
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf build megatron_p2p/*.so
