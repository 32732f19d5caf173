# make demo  - pack a generated image folder into every format and compare them
# make test  - run the whole test suite
# Both create .venv on first use and install the project with pinned torch builds.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): setup.cfg setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23" "setuptools>=61"
	$(PY) -m pip install --quiet -c constraints.txt torch torchvision -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check packed_formats tests tools

clean:
	rm -rf $(VENV) demo_data .pytest_cache
