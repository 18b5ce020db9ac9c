# Two commands from a bare machine with Python 3.9+ and make:
#   make demo       the main job (launch/compare.py): nine short GPT trainings, a report and a plot
#   make test       the whole test suite (tests/, gpu_check/tests/, studies/tests/: pytest.ini's testpaths)
#   make test-fast  the tests without multi-rank DeepSpeed launches and slow builds (a few minutes)
#   make test-gpu   the tests that need a CUDA GPU (they skip without one)
# Each creates .venv and installs the project into it the first time (a CUDA 13.0 build of torch,
# about 5.8 GB, from this machine's wheel cache or PyPI), and reinstalls only when
# requirements-dev.txt or setup.py change. PYTHON picks the interpreter (default python3).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the CUDA toolkit, found where it is (CUDA_HOME overrides): torch's own guess can be a wrapper's folder
export CUDA_HOME ?= $(shell $(PYTHON) ds_q8/op_builder/toolkit.py)

.PHONY: demo test test-fast test-gpu install

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements-dev.txt setup.py | $(PY)
	@echo "installing into $(VENV) (first time: a few minutes, about 6 GB)"
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e ".[train,test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) launch/compare.py
	@echo "report: out/compare/report.md"
	@echo "plot:   out/compare/loss.png"

# one pytest-xdist worker per core, each taking whole modules (their fixtures are shared by their tests) in
# collection order: the longest first (tests/helpers/plugin.py), not xdist's order by number of tests
XDIST := -n auto --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=40

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not multirank"

test-gpu: $(STAMP)
	$(PY) -m pytest -q -rs -m gpu
