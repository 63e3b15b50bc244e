# Two entry points for a fresh clone: `make demo` (the main example) and `make test` (the suite).
# The suite runs each case once, in the environment where it means something: what needs torch_xla
# (marked `xla`) in torch 2.9 with torch_xla (.venv, `make test-xla`), everything else in the newest
# torch these machines install, without torch_xla (.venv-newest, `make test-newest`). The xla
# environment also runs the fast loop's cases (`fast`: each layer once), so torch 2.9, the oldest
# torch supported, is checked layer by layer without torch_xla's paths too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NEWEST_VENV := .venv-newest
PY_NEWEST := $(NEWEST_VENV)/bin/python
# The newest release pip installs here (capped at 2.14.1 by /etc/xdg/pip), with its torchvision.
NEWEST_TORCH ?= torch==2.14.1 torchvision==0.29.1
# FSDP2 clients test_torchtitan runs unchanged (torch >= 2.11, so only here). torchtitan without its
# declared dependencies: it pins datasets<4.8 (this env is green with 5.0.1, which its loop runs on) and
# wants wandb for a logger the test does not use; what its training loop imports is listed instead.
NEWEST_CLIENTS := torchtitan
NEWEST_CLIENT_DEPS := torchdata tyro tensorboard spmd_types
# Test files run on this many pytest-xdist workers, a whole file per worker (its module fixtures run
# once). 2 on this 2-core machine: each test file also starts its own ranks. --no-loadscope-reorder:
# files are handed out in conftest's order, slowest first (xdist otherwise re-sorts them by test count).
TEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 test
STAMP := $(VENV)/.installed-stamp
NEWEST_STAMP := $(NEWEST_VENV)/.installed-stamp

.PHONY: demo test test-fast test-changed test-xla test-newest install install-both clean

$(STAMP): setup.py test/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[xla,test]' -c test/constraints.txt
	touch $(STAMP)

$(NEWEST_STAMP): setup.py test/constraints-newest.txt
	test -x $(PY_NEWEST) || $(PYTHON) -m venv $(NEWEST_VENV)
	$(PY_NEWEST) -m pip install --quiet --upgrade pip
	$(PY_NEWEST) -m pip install --quiet -e '.[test]' $(NEWEST_TORCH) $(NEWEST_CLIENT_DEPS) -c test/constraints-newest.txt
	$(PY_NEWEST) -m pip install --quiet --no-deps $(NEWEST_CLIENTS) -c test/constraints-newest.txt
	touch $(NEWEST_STAMP)

install: $(STAMP)

install-both:
	$(MAKE) -j2 $(STAMP) $(NEWEST_STAMP)

demo: $(STAMP)
	$(PY) examples/train_resnet_fsdp_auto_wrap.py

# Each environment prints its wall time and slowest files; the last lines sum both (tools/test_times.py).
# A fresh clone installs both environments at once (each pip install is one core's work: 60 s saved).
test: install-both test-xla test-newest
	@$(PY) tools/test_times.py --summary

# The fast loop, for a change in progress (about a minute here): each layer once, marked `fast`
# (docs/testing.md lists what it covers). Not a substitute for make test before a commit lands.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m fast test

# The test files a change touches (uncommitted and untracked files against HEAD, or BASE=rev), in the
# environment where each case runs: tools/changed_tests.py says how files are picked.
BASE ?= HEAD
test-changed: $(STAMP) $(NEWEST_STAMP)
	@files="$$($(PY) tools/changed_tests.py --base $(BASE))"; \
	if [ -z "$$files" ]; then echo "no test file touched by the change against $(BASE)"; exit 0; fi; \
	echo "$$files"; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m xla $$files; a=$$?; \
	$(PY_NEWEST) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not xla" $$files; b=$$?; \
	for rc in $$a $$b; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

test-xla: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "xla or fast" --junitxml=.test-times/xla-env.xml

# also needs .venv: test_cross_version.py trains legs of one run in both environments
test-newest: $(NEWEST_STAMP) $(STAMP)
	$(PY_NEWEST) -m pytest $(PYTEST_ARGS) -m "not xla" --junitxml=.test-times/newest-env.xml

clean:
	rm -rf $(VENV) $(NEWEST_VENV) *.egg-info .test-times
