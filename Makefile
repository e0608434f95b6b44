# mqstore: the two fresh-machine commands are `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PYSPARK_PYTHON := $(abspath $(BIN)/python)
export PYSPARK_DRIVER_PYTHON := $(abspath $(BIN)/python)
SEEDS   ?= 1000
RUN_DIR ?= /tmp/mqstore-run

.PHONY: install sysdeps run test test-fast bench sim soak up drill down clean image test-docker fuzz

install: $(STAMP) sysdeps

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Debian packages some test tiers need, installed when missing and we are root: Java 17 (Spark
# pipeline), iptables and iproute2 (network-namespace drills), chromium (dashboard browser test),
# a C compiler (the wall-clock step shim, tests/integration/wallclock_shim.c).
APT_GET := apt-get -y -qq -o Dpkg::Use-Pty=0
sysdeps:
	@need=""; \
	command -v java >/dev/null || need="$$need openjdk-17-jre-headless"; \
	{ command -v iptables >/dev/null && command -v ip >/dev/null; } || need="$$need iptables iproute2"; \
	{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || need="$$need chromium chromium-driver"; \
	command -v cc >/dev/null || need="$$need gcc libc6-dev"; \
	if [ -n "$$need" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$need"; apt-get update -qq && $(APT_GET) install $$need >/dev/null; \
	  else echo "note: some test tiers need Debian packages:$$need (apt-get install as root)" >&2; fi; \
	fi

run: install          ## a local cluster on loopback as plain processes (SECURE=1: ACL and peer auth on)
	$(BIN)/mqstore cluster up --dir $(RUN_DIR) $(if $(SECURE),--secure)

test: install         ## every test tier that needs no Docker engine
	$(BIN)/python -m pytest -q -m "not docker"

test-fast: install    ## unit, property and simulation tiers only
	$(BIN)/python -m pytest -q tests/unit tests/property tests/sim

bench: install        ## benchmarks, JSON on stdout (NATS JetStream anchors need Debian's nats-server)
	@command -v nats-server >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  apt-get install -y -qq nats-server >/dev/null; } || echo "note: nats-server missing; NATS anchors will be null" >&2
	$(BIN)/python -m bench

sim: install          ## deterministic simulation over many seeds
	$(BIN)/python -m tests.sim.run --seeds $(SEEDS)

SOAK_SEEDS   ?= 5
SOAK_START   ?= 1
SOAK_SECONDS ?= 60
soak: install         ## seeded random faults on real processes, a 3-node DLedger group then a classic HA group (SOAK_SEEDS x SOAK_SECONDS each), then every safety check
	$(BIN)/python -m tests.integration.nemesis --seeds $(SOAK_SEEDS) --start $(SOAK_START) --seconds $(SOAK_SECONDS) --keep $(RUN_DIR)-soak
	$(BIN)/python -m tests.integration.ha_nemesis --seeds $(SOAK_SEEDS) --start $(SOAK_START) --seconds $(SOAK_SECONDS) --keep $(RUN_DIR)-soak

FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= message dledger_entry entry_store consume_queue index_file ha_protocol raft_codec raft_transport rest_api rest_app produce_stream
fuzz: install         ## every atheris harness for FUZZ_SECONDS each (finds go to /tmp/mqstore-fuzz/<target>)
	@for t in $(FUZZ_TARGETS); do echo "== fuzz.$$t ($(FUZZ_SECONDS) s)"; \
	  $(BIN)/python -m fuzz.$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || exit 1; done

IMAGE   ?= mqstore:latest
PROJECT ?= mqstore
DRILL   ?= kill_leader kill_master
DRILLS  := $(BIN)/python -m deploy.drills --project $(PROJECT)

image: install        ## node/controller image from this tree (cached layers); offline base via debootstrap (docs/deploy.md)
	deploy/ensure-docker.sh
	PYTHON=$(abspath $(BIN)/python) deploy/build-image.sh $(IMAGE)

up: image            ## the docker-compose cluster: (re)builds the image from this tree, waits until healthy
	MQSTORE_IMAGE=$(IMAGE) $(DRILLS) up

down:                 ## stop the compose cluster (volumes kept; `make clean` removes them)
	$(DRILLS) down

drill: install        ## failover drills against the running cluster (DRILL="kill_leader ..." or all)
	$(DRILLS) $(DRILL)

.PHONY: drill-netns drill-matrix
drill-netns: install  ## the same drills without Docker: processes in network namespaces (root; DRILL=...)
	@command -v iptables >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq iptables >/dev/null; } || \
	  echo "note: the netns tier needs root, iproute2 and iptables" >&2
	$(DRILLS) --tier netns $(DRILL)

DRILL_SECONDS ?= 180
drill-matrix: install ## every scenario for DRILL_SECONDS of load each; table in reports/drill-matrix.{md,json}
	$(BIN)/python -m deploy.drills.matrix --project $(PROJECT) --seconds $(DRILL_SECONDS)

test-docker: image    ## docker-marked tests: their own compose project, every drill in a short form
	MQSTORE_IMAGE=$(IMAGE) $(BIN)/python -m pytest -q -m docker tests/docker

clean:
	rm -rf $(RUN_DIR)
	@! docker info >/dev/null 2>&1 || [ ! -x $(BIN)/python ] || $(DRILLS) clean
