# Singularity for Slurm. Run as root on Debian 12/13:
#   make demo   - bring the local two-node dev cluster up and show preemption of an SLA tier
#   make test   - install what is missing, bring the dev cluster up, run unit and integration tests
PREFIX ?= /opt/singularity-slurm
VENV := $(PREFIX)/venv
PY := $(VENV)/bin/python
CTL := $(VENV)/bin/singularityctl
SYSTEM_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=

.PHONY: all install devcluster test unit integration demo lint down clean kernels

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

# The proxy's reduction kernels as PTX, which the driver loads on a GPU node (no compiler there). nvcc
# 13 labels its PTX ISA 9.0 (drivers 580 and newer); the kernels use nothing newer than ISA 8.0, so the
# file says 8.0, which the drivers the checkpoint API needs (570 and newer) load too. The unit tests
# check that the committed file is what this rule makes of reduce.cu.
kernels:
	nvcc -ptx -arch=compute_75 --fmad=false -o proxy/kernels/reduce.ptx.tmp proxy/kernels/reduce.cu
	sed 's/^\.version 9\.0$$/.version 8.0/' proxy/kernels/reduce.ptx.tmp > proxy/kernels/reduce.ptx
	rm proxy/kernels/reduce.ptx.tmp

down:
	-$(CTL) devcluster down

clean:
	rm -rf build *.egg-info
