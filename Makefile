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
# the browser, the scheduler outages, the real Slurm); `make test-slow` runs those but Slurm's; `make test-slurm`
# runs the Slurm tests alone, in one process (beside other tests their one-node Slurm's job launches fail: munge
# answers "Unauthorized credential"); `make test-all` all three. CI runs all three.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow and not slurm"

test-slurm: $(STAMP)
	$(BIN)/python -m pytest -n0 -m slurm

test-all: test test-slow test-slurm

# The documentation site, built strictly into site/ (a broken link or API reference fails it).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

bench-ledger: $(STAMP)
	$(BIN)/python bench/ledger.py

clean:
	rm -rf $(VENV) .aisched .pytest_cache site
