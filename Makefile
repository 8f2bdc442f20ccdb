# snip-megatron: `make demo` runs the quickstart, `make test` runs the suite in every lane.
SHELL := /bin/bash
.DEFAULT_GOAL := help
# Longest first, two at a time: the bridge lane (about 12 minutes) beside prod:runs (about 23), then
# prod:units and compat where bridge ended, so neither core idles at the end.
LANES := prod:runs bridge prod:units compat:runs compat:units
PYTEST_ARGS ?=

.PHONY: help demo test test-fast test-prod test-compat test-bridge env env-prod env-compat env-bridge clean

help:
	@echo "make demo        tiny Llama-like pretraining with SNIP on CPU, on real text"
	@echo "make test        create the environments if missing, run each lane's tests"
	@echo "make test-fast   the prod lane's in-process tests only (no test marked launches): a few minutes"
	@echo "make env-prod    Python 3.12, torch 2.14.1, megatron-core 0.19.2 (.venv-prod)"
	@echo "make env-compat  Python 3.11, torch 2.13.0 CPU, megatron-core 0.16.1 (.venv-compat)"
	@echo "make env-bridge  Python 3.12, torch 2.14.1, megatron-core 0.19.2, megatron-bridge 0.6.2 (.venv-bridge)"

env: env-prod env-compat env-bridge
env-prod:
	@scripts/make_env.sh prod
env-compat:
	@scripts/make_env.sh compat
env-bridge:
	@scripts/make_env.sh bridge

demo: env-prod
	.venv-prod/bin/python -m snip_megatron.demo

# run_tests.sh creates each lane's environment if missing, beside the lanes already testing.
test:
	@scripts/run_tests.sh $(LANES) -- $(PYTEST_ARGS)

# The tests that start no process (pytest.ini's `launches` marker; tests/test_launch_marks.py).
test-fast:
	@scripts/run_tests.sh prod -- -m "not launches" $(PYTEST_ARGS)

test-prod:
	@scripts/run_tests.sh prod -- $(PYTEST_ARGS)
test-compat:
	@scripts/run_tests.sh compat -- $(PYTEST_ARGS)
test-bridge:
	@scripts/run_tests.sh bridge -- $(PYTEST_ARGS)

clean:
	rm -rf .venv-prod .venv-compat .venv-bridge .pytest_cache
