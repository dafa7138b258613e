# Two entry points for a fresh machine (see README):
#   make run    creates .venv, installs the package, runs the main job
#   make test   creates .venv, installs the package with its test extras, runs the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,cuda]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hal run recipes/default.yaml --compare overwrite=true

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
