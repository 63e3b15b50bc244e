# Two entry points for a fresh clone: `make demo` (the main example) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_resnet_fsdp_auto_wrap.py

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 test

clean:
	rm -rf $(VENV) *.egg-info
