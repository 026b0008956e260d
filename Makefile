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
	$(PY) -m pip install -q --no-cache-dir ".[test,criu,examples]"
	chmod -R a+rX $(PREFIX)

devcluster: install
	$(CTL) devcluster up

unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: devcluster
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# Unit and integration tests side by side: the integration tests keep to one worker (tests/conftest.py).
test: devcluster
	$(PY) -m ruff check .
	$(PY) -m pytest tests -n 2 --dist loadgroup $(PYTEST_ARGS)

demo: devcluster
	$(PY) examples/demo.py

lint: install
	$(PY) -m ruff check .

down:
	-$(CTL) devcluster down

clean:
	rm -rf build *.egg-info
