# Two commands for a newcomer:
#   make run   set up .venv when missing, then run the main job on the default model
#   make test  set up .venv when missing, then run the whole test suite
.PHONY: setup run test test-fast lint

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/speculative demo

test: setup
	.venv/bin/ruff check src tests
	.venv/bin/python -m pytest -q

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

lint: setup
	.venv/bin/ruff check src tests
