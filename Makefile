# The two commands a newcomer needs: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
PIP ?= $(PY) -m pip
STAMP := .rose-stack/.installed
DEMO_DURATION ?= 180
DEMO_REPORT ?= reports/demo

.PHONY: install lint test test-fast demo stack-up stack-down bench clean

$(STAMP): pyproject.toml
	@command -v java >/dev/null || (echo "installing Java 17 ..." && apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless)
	@command -v mvn >/dev/null || (echo "installing Maven ..." && apt-get update -qq && apt-get install -y -qq maven)
	@# the package's own service is stopped: the tests run the Redis of their own stack
	@command -v redis-server >/dev/null || (echo "installing redis-server ..." && apt-get update -qq && apt-get install -y -qq redis-server \
	  && (service redis-server stop >/dev/null 2>&1 || true))
	$(PIP) install -q --disable-pip-version-check -e ".[all]"
	@mkdir -p .rose-stack && touch $(STAMP)

install: $(STAMP)

stack-up: install
	rose stack up

stack-down:
	-rose stack down

# Lint, format and types: what CI and the pre-commit hooks check.
lint: install
	ruff check rose tests consumers producers
	ruff format --check rose tests consumers producers
	mypy

# Starts the real Kafka and Redis, runs every test against them, stops them (also on failure;
# ROSE_KEEP_STACK=1 keeps them running). Refuses, starting nothing, when another checkout's stack
# or another program holds the stack's ports: the tests stop and restart the services they own.
test: install lint
	rose stack up --own --jaeger
	ROSE_KEEP_STACK=1 $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	  [ "$$ROSE_KEEP_STACK" = 1 ] || rose stack down; exit $$rc

# The whole system end to end on the local stack, with a live view and a report.
demo: install
	rose stack up
	rose demo --duration $(DEMO_DURATION) --report $(DEMO_REPORT)
	@echo "report: $(DEMO_REPORT)/report.md"

bench: install
	rose stack up
	@for b in $$(rose bench list | cut -d' ' -f1); do rose bench $$b --json; done

clean: stack-down
	rm -rf .rose-stack reports

# The paper check (docs/paper-check.md): rose simulate on the Azure and BurstGPT traces, 7B–70B, beside the paper's claim.
paper-check: install
	rose paper-check --out reports/paper-check/default.md
	rose --config-file docs/paper-check/no-trend.toml paper-check --out reports/paper-check/no-trend.md
	@echo "tables: reports/paper-check/default.md reports/paper-check/no-trend.md"
