# make demo       - pack a generated image folder into every format and compare them
# make test       - lint, type check, then run the whole test suite (what CI runs)
# make test-fast  - the quick tier: every test not marked slow (about four minutes)
# make notebooks  - run the teaching notebooks and store their outputs (the test suite checks them)
# make lint       - ruff only;  make typecheck - mypy only
# Each creates .venv on first use and installs the project with pinned torch builds.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast notebooks lint typecheck clean

$(STAMP): setup.cfg setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23" "setuptools>=61"
	$(PY) -m pip install --quiet -c constraints.txt torch torchvision -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: lint typecheck
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

notebooks: $(STAMP)
	$(PY) tools/notebooks.py run

lint: $(STAMP)
	$(VENV)/bin/ruff check packed_formats tests tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy packed_formats

clean:
	rm -rf $(VENV) demo_data .pytest_cache
