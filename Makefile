# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv if it
# is missing and installs the package with its dependencies into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build the virtual environment starts from (a CPU build where one lies on the
# local disk); an environment that already has torch >= 2.11 keeps its own.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint gpu-test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,hf,bench]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m graphattn demo

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# On a CUDA machine: the gpu-marked tests.
gpu-test: $(VENV)/.installed
	$(PY) -m pytest -m gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
