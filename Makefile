# The README's commands: `make demo` and `make test`; `make lint`, the fast and
# the slow halves of the suite, and the benchmarks (run by hand, not in CI).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUN    ?= runs/demo
RANKS  ?= 2
PORT   ?= 5000
# The fast half: no msrun job, no browser, no fresh venv (about a minute).
FAST   := not msrun and not browser and not slow

.PHONY: venv demo test test-fast test-slow lint format bench bench-overhead bench-soak bench-goodput wheel clean

venv: $(VENV)/.installed

# The development venv: editable, with MindSpore (the trainer extra), the
# test tools and ruff.
# pip's own progress is shown: the install is large, and silence looks hung.
$(VENV)/.installed: pyproject.toml
	@echo "make venv: installing Rankwatch with MindSpore (the trainer extra), the test tools and ruff"
	@echo "           into $(VENV): about 3 GB, a few minutes on a fast network (3.1 GB in 203 s measured)"
	@echo "           MindSpore is most of it (2.5 GB installed): pip's bar can sit at [mindspore] for minutes"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	touch $@
	@echo "make venv: done; run the CLI as $(VENV)/bin/rankwatch (or: source $(VENV)/bin/activate)"

# make demo PORT=5001 (or PORT=0 for a free one), RUN=runs/other, RANKS=4
demo: venv
	$(VENV)/bin/rankwatch demo --run-dir $(RUN) --ranks $(RANKS) --port $(PORT)

# Four workers (pytest-xdist) on 2 cores: most tests wait on msrun jobs (MindSpore's
# start and end are mostly waiting), so more workers than cores keep the cores busy.
# Idle runs of the whole suite: 32 min 18 s with two workers, 24 min 47 s and
# 25 min 29 s with three, 22 min 54 s and 21 min 18 s with four (README, "The two
# commands"). The tests' jobs train batches of 8 (tests/helpers/jobs.py); when they
# trained the demo's 32, three workers were measured no faster than two.
# --dist worksteal: a worker that runs out takes half of another's queue.
# xdist's default (load) leaves each worker its queue, which at the end can
# hold minutes of msrun jobs while the others idle.
# Debug one test without it: .venv/bin/python -m pytest tests/x.py -k name
test: venv
	$(PY) -m pytest -ra --durations=40 -n 4 --dist worksteal

test-fast: venv
	$(PY) -m pytest -ra -m "$(FAST)"

test-slow: venv
	$(PY) -m pytest -ra -m "not ($(FAST))"

# lint-imports holds the layering of app/, the trainer's contract and the tests'
# import rule (pyproject.toml); tests.lint the tests' one token and app fixture,
# no import cycle, and no module of app/ or trainer_bridge/ past 500 lines.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m tests.lint

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Each prints its figures against a baseline measured in the same run. The
# bridge's overhead (tests.bench.loop, tests.bench.bridge figure 1) needs a
# quiet machine; BENCH_FLAGS=--quick checks the harness in a few minutes.
BENCH_FLAGS ?=
bench: venv
	$(PY) -m tests.bench.scale --ranks 64 256 1024
	$(PY) -m tests.bench.loop $(BENCH_FLAGS)
	$(PY) -m tests.bench.bridge $(BENCH_FLAGS)
	$(PY) -m tests.bench.ckpt_meta

# Only the bridge's overhead: both front ends, both step sizes.
bench-overhead: venv
	$(PY) -m tests.bench.loop $(BENCH_FLAGS)
	$(PY) -m tests.bench.bridge --figures 1 $(BENCH_FLAGS)

bench-soak: venv
	$(PY) -m tests.bench.soak

# Goodput under injected faults: plain msrun, rankwatch launch, and launch with the dying gasp
# (about 25 min per way; BENCH_FLAGS=--quick: about 10 min in all).
bench-goodput: venv
	$(PY) -m tests.bench.goodput $(BENCH_FLAGS)

wheel: venv
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf runs dist build .pytest_cache
