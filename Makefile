# make demo       - pack a generated image folder into every format and compare them
# make test       - lint, type check, then run the whole test suite (what CI runs)
# make test-fast  - the quick tier: every test not marked slow
# make notebooks  - run the teaching notebooks and store their outputs (the test suite checks them)
# make lint       - ruff only;  make typecheck - mypy only
# make docs       - the documentation (API reference, command line, guide, notebooks) into
#                   docs/_build/html, warnings as errors
# make test-compat - the quick tier on the oldest versions setup.cfg accepts (Python 3.9,
#                    constraints-floor.txt) and on the newest releases pip resolves (Python 3.13);
#                    their venvs are cached outside the repository (see tools/compat.sh)
# Each creates .venv on first use and installs the project with pinned torch builds.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-compat notebooks docs lint typecheck clean

# The first run downloads or unpacks several GB (torch with its CUDA libraries): each step says what it
# installs and pip shows its progress, so a long step is seen to be working.
$(STAMP): setup.cfg setup.py constraints.txt
	@echo "== [1/3] creating the environment $(VENV) (once)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== [2/3] upgrading pip and setuptools in $(VENV)"
	$(PY) -m pip install --upgrade "pip>=23" "setuptools>=64"
	@echo "== [3/3] installing torch, torchvision (constraints.txt; several GB) and packed_formats[test] into $(VENV)"
	$(PY) -m pip install -c constraints.txt torch torchvision -e ".[test]"
	touch $(STAMP)
	@echo "== $(VENV) is ready"

demo: $(STAMP)
	$(PY) tools/demo.py

# Three streams (tools/run_tests.py): the tests that can share the machine on two xdist workers, then those
# marked serial (they need the whole machine), one at a time; from the start, beside both, those marked
# beside (they mostly wait: Slurm, the store servers, pip), one at a time.  tests/conftest.py says which and
# why.  All always run; the exit status is the first failure's; the slowest test files and the wall time
# come last.
test: lint typecheck
	$(PY) tools/run_tests.py --label "make test"

test-fast: $(STAMP)
	$(PY) tools/run_tests.py --fast --label "make test-fast"

test-compat:
	tools/compat.sh floor
	tools/compat.sh newest

notebooks: $(STAMP)
	$(PY) tools/notebooks.py run

docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check packed_formats tests tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy packed_formats

clean:
	rm -rf $(VENV) demo_data .pytest_cache docs/_build docs/notebooks
