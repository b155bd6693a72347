# Two commands for a newcomer:
#   make run   set up .venv when missing, then run the main job on the default model
#   make test  set up .venv when missing, then run the whole test suite
.PHONY: setup run test test-fast test-avx2 lint peers

# Hold oneDNN, ATen, MKL and our C kernels to AVX2, as on an AVX2-only CPU.
AVX2_ONLY = ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	SPECULATIVE_KERNEL_ISA=avx2
# The tests whose results depend on the CPU's instruction set (kernels, k-invariance).
ISA_TESTS = tests/test_native.py tests/test_kernels.py tests/test_profile.py tests/test_tree_models.py \
	tests/test_soft_ce.py

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/speculative demo

test: setup
	.venv/bin/ruff check src tests
	.venv/bin/python -m pytest -q --durations=15
	$(MAKE) --no-print-directory test-avx2

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

# The instruction-set-dependent tests again, with every library held to AVX2: an AVX-512
# machine then checks what an AVX2-only one would run.
test-avx2: setup
	@echo "--- again with the libraries held to AVX2: $(ISA_TESTS)"
	$(AVX2_ONLY) .venv/bin/python -m pytest -q -m "not slow" $(ISA_TESTS)

lint: setup
	.venv/bin/ruff check src tests

# Optional peers for `speculative bench`: llama.cpp through llama-cpp-python, built from the
# package registry (compiles llama.cpp: about 25 minutes on 2 cores).
peers: setup
	.venv/bin/python -m pip install "llama-cpp-python==0.3.36"
