# Singularity for Slurm. Run as root on Debian 12/13:
#   make demo   - bring the local two-node dev cluster up and show preemption of an SLA tier
#   make test   - install what is missing, bring the dev cluster up, run unit and integration tests
PREFIX ?= /opt/singularity-slurm
VENV := $(PREFIX)/venv
PY := $(VENV)/bin/python
CTL := $(VENV)/bin/singularityctl
SYSTEM_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=

.PHONY: all install devcluster test unit integration demo lint down clean

all: install

# A virtual environment every user can run (the job user runs the launcher from it), built on
# Debian's python3: a Python under /root is not readable by other users.
$(PY):
	@command -v $(SYSTEM_PYTHON) >/dev/null && $(SYSTEM_PYTHON) -c 'import venv, ensurepip' 2>/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev; }
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q --no-cache-dir ".[test,criu,examples,sim]"
	chmod -R a+rX $(PREFIX)

devcluster: install
	$(CTL) devcluster up

unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: devcluster
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# The unit tests (no cluster) run beside the integration tests, which share the cluster one at a
# time; their report follows the integration tests', and both must pass.
test: devcluster
	$(PY) -m ruff check .
	@unit_log=$$(mktemp) && \
	{ $(PY) -m pytest tests/unit $(PYTEST_ARGS) >$$unit_log 2>&1 & unit=$$!; } && \
	{ $(PY) -m pytest tests/integration $(PYTEST_ARGS); integration=$$?; } ; \
	wait $$unit; unit_status=$$?; \
	echo "=== unit tests (run beside the integration tests) ==="; cat $$unit_log; rm -f $$unit_log; \
	test $$integration -eq 0 && test $$unit_status -eq 0

demo: devcluster
	$(PY) examples/demo.py

lint: install
	$(PY) -m ruff check .

down:
	-$(CTL) devcluster down

clean:
	rm -rf build *.egg-info
