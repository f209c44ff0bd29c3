# Everything a fresh clone needs: `make demo` and `make test` set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: install demo demo-server demo-server-stop test test-slow test-slurm test-all docs bench bench-ledger clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	mkdir -p .aisched/prefect
	AISCHED_HOME=$(CURDIR)/.aisched PREFECT_HOME=$(CURDIR)/.aisched/prefect \
		$(BIN)/python -m flows.nightly

# A local Prefect server and process worker on 127.0.0.1, the deployments of prefect.yaml, one nightly run.
demo-server: $(STAMP)
	$(BIN)/python -m flows.demo_server up

demo-server-stop:
	$(BIN)/python -m flows.demo_server down

# `make test`: everything but the tests marked slow (a minute or more each: the walk-through page, the deployment,
# the browser, the scheduler outages, the real Slurm); `make test-slow` runs those, the Slurm ones beside the others
# (each test Slurm keeps its Unix sockets in a short folder of its own: tests/slurm_cluster.py); `make test-slurm`
# runs only the Slurm tests; `make test-all` runs test and test-slow, as CI does.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow"

test-slurm: $(STAMP)
	$(BIN)/python -m pytest -m slurm

test-all: test test-slow

# The documentation site, built strictly into site/ (a broken link or API reference fails it).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

bench-ledger: $(STAMP)
	$(BIN)/python bench/ledger.py

clean:
	rm -rf $(VENV) .aisched .pytest_cache site
