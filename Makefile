# Two entry points for a fresh clone: `make demo` (the main example) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Test files run on this many pytest-xdist workers, a whole file per worker (its module fixtures run
# once). 2 on this 2-core machine: each test file also starts its own ranks.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

$(STAMP): setup.py test/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' -c test/constraints.txt
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_resnet_fsdp_auto_wrap.py

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 test

clean:
	rm -rf $(VENV) *.egg-info
