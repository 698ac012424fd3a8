# Two targets do all the set-up on a fresh machine: `make check` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.triforge-installed
PYTEST_WORKERS ?= 2

.PHONY: check test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

check: $(STAMP)
	$(VENV)/bin/triforge check

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) tests

clean:
	rm -rf $(VENV) build *.egg-info
