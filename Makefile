# Two commands do everything on a fresh machine:
#   make demo   - install, then train on the embedded default cluster (clusters/local-2dc.yaml)
#   make test   - install, then lint and run the test suite
#   make test-fast - the unit tier only (tests/unit: no Ray, no DeepSpeed; about a minute on 2 cores)
# torch is installed explicitly first: an unpinned torch pulls a multi-GB CUDA build on
# CPU-only machines. pyproject keeps its own torch range loose for GPU users.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install demo demo-llama plan test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/geopipe launch clusters/local-2dc.yaml

# A Llama (clusters/models/llama-tiny) on the built-in stdlib-bpe token dataset, in bf16,
# then exported to runs/llama-tiny-2dc/hf: a directory transformers loads.
demo-llama: install
	$(VENV)/bin/geopipe launch clusters/llama-tiny-2dc.yaml
	$(VENV)/bin/geopipe export runs/llama-tiny-2dc --out runs/llama-tiny-2dc/hf --force

plan: install
	$(VENV)/bin/geopipe plan clusters/local-2dc.yaml

lint: install
	$(VENV)/bin/ruff check geopipe tests benchmarks
	$(VENV)/bin/ruff format --check geopipe tests benchmarks
	$(VENV)/bin/lint-imports

# The unit tier is pure and runs on both cores (pytest-xdist). The integration tier runs on
# two xdist workers too, a module at a time (tests/conftest.py, [Note: two workers finishing
# together]): a module's shared reference runs are made once; the longest modules go first
# and the short ones fill in at the end. The tests that start their own Ray (the CLI
# launches, the multi-node cluster: marked own_ray) are the first module of each worker;
# after them each worker starts an embedded Ray of its own when a test first asks for one.
# Two workers are not twice as fast: a launch's actor start-up (each actor imports torch and
# DeepSpeed, ~4-5 s of CPU) keeps both cores busy on its own; together they come to ~1.3x.

# Where Python runs with PYTHONDONTWRITEBYTECODE set (as on our test machine), every process
# (each stage actor of every launch included) compiles geopipe's sources again: ~0.3 s of CPU
# an actor. Compiled once here instead; a checked-hash .pyc is used only while it matches
# its source, so an edit since is never run stale.
PYC := $(PY) -m compileall -q --invalidation-mode checked-hash geopipe tests

# The unit tier runs three workers on two cores: 30 % of its wall time was spent waiting
# (sockets, deadlines, subprocesses), 76 s with two workers, 61-68 s with three, 65 s with four.
UNIT := $(VENV)/bin/python -m pytest -q -n 3 tests/unit

test: lint
	$(PYC)
	$(UNIT)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/integration

test-fast: install
	$(PYC)
	$(UNIT)

bench: install
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) runs .pytest_cache
