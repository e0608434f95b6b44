# mqstore: the two fresh-machine commands are `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PYSPARK_PYTHON := $(abspath $(BIN)/python)
export PYSPARK_DRIVER_PYTHON := $(abspath $(BIN)/python)
SEEDS   ?= 1000
RUN_DIR ?= /tmp/mqstore-run

.PHONY: install run test test-fast bench sim up drill down clean lint

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@command -v java >/dev/null || echo "note: Java 17 is needed for the Spark pipeline (apt-get install -y openjdk-17-jre-headless)"
	touch $(STAMP)

run: install          ## a local cluster on loopback as plain processes
	$(BIN)/mqstore cluster up --dir $(RUN_DIR)

test: install         ## every test tier that needs no Docker engine
	$(BIN)/python -m pytest -q -m "not docker"

test-fast: install    ## unit, property and simulation tiers only
	$(BIN)/python -m pytest -q tests/unit tests/property tests/sim

bench: install        ## benchmarks, JSON on stdout
	$(BIN)/python -m bench

sim: install          ## deterministic simulation over many seeds
	$(BIN)/python -m tests.sim.run --seeds $(SEEDS)

up drill down:
	@echo "make $@: the docker-compose cluster is not built yet (see the README's status section)" >&2; exit 2

clean:
	rm -rf $(RUN_DIR)
