# Two commands do everything on a fresh machine:
#   make demo   - install, then train on the embedded default cluster (clusters/local-2dc.yaml)
#   make test   - install, then lint and run the test suite
#   make test-fast - the unit tier only (tests/unit: no Ray, no DeepSpeed; under a minute)
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

# The unit tier is pure and runs on both cores (pytest-xdist). The integration tier's tests
# that start their own Ray or need none running (marked own_ray by tests/conftest.py) run
# first, alone; the rest on two xdist workers, each with an embedded Ray of its own, one
# module per worker (a module's shared reference runs are made once): a launch spends most
# of its time starting actors and waiting on them, so two at a time fill the two cores.
test: lint
	$(VENV)/bin/python -m pytest -q -n 2 tests/unit
	$(VENV)/bin/python -m pytest -q -m own_ray tests/integration
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not own_ray" tests/integration

test-fast: install
	$(VENV)/bin/python -m pytest -q -n 2 tests/unit

bench: install
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) runs .pytest_cache
