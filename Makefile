# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUN    ?= runs/demo
RANKS  ?= 2

.PHONY: venv demo test bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: venv
	$(PY) -m trainer_bridge.demo --run-dir $(RUN) --ranks $(RANKS) --dashboard

test: venv
	$(PY) -m pytest -ra

clean:
	rm -rf runs .pytest_cache
