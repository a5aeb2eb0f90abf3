# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv if missing, installs the pinned dependencies and the project into it, and runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE_SOURCES := $(shell find native -name '*.cc' -o -name '*.h' 2>/dev/null)
DEMO_DIR ?= demo_out
DEMO_SAMPLES ?= 200000

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements.txt requirements-test.txt $(NATIVE_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(PY) -m pipelines.generate --schema schemas/examples/taobao_like.yaml \
	    --samples $(DEMO_SAMPLES) --out $(DEMO_DIR)/raw --seed 7
	$(PY) -m compression.compress --schema schemas/examples/taobao_like.yaml \
	    --input '$(DEMO_DIR)/raw/*.parquet' --output $(DEMO_DIR)/trees
	$(PY) -m compression.inspect $(DEMO_DIR)/trees

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_DIR)
