# Two commands do all the set-up on a fresh Linux machine with Python 3.11:
#   make demo   runs the whole pipeline on the embedded stack
#   make test   runs the whole test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite mostly waits (brokers, demo runs, restarts), so it runs its tests side by side: TEST_WORKERS
# pytest-xdist workers, tests that share setup grouped on one worker (tests/README.md). TEST_WORKERS=0
# runs it in one process, in file order.
TEST_WORKERS ?= 4
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

.PHONY: install refresh test test-slow test-fast test-changed test-profile demo demo-hf demo-tools demo-agent lint lint-infra bench clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]' --config-settings editable_mode=strict
	@touch $(STAMP)

install: $(STAMP)

# The strict editable install links each file; a new module or data file (a systemd unit) needs the
# link tree refreshed.
refresh: $(STAMP)
	@find fleetrl broker hub rollout trainer regions -name '*.py' -o -name '*.service' | sort > $(VENV)/.files.new
	@cmp -s $(VENV)/.files.new $(VENV)/.files || { \
		$(PIP) install --quiet --no-deps -e . --config-settings editable_mode=strict && \
		mv $(VENV)/.files.new $(VENV)/.files; }

test: refresh
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

# The suite on a machine SLOWDOWN times slower than this one, emulated with a CPU quota (a cgroup: needs
# root, and cgroup v1 or v2 with the cpu controller; tests/cpu_quota.sh). Every deadline scales by the
# slowdown the suite measures at its start (tests/slowdown.py), so it must pass there as here.
SLOWDOWN ?= 2.5
test-slow: refresh
	tests/cpu_quota.sh $(SLOWDOWN) $(MAKE) --no-print-directory test

test-fast: refresh
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -m "not slow and not e2e and not integration" $(PYTEST_ARGS)

# The inner loop: the tests of what differs from BASE (tests/changed.py), the slow ones left out unless
# CHANGED_MARKS is emptied (make test-changed CHANGED_MARKS=).
BASE ?= main
CHANGED_MARKS ?= not slow
test-changed: refresh
	@paths="$$($(PY) tests/changed.py $(BASE))" || exit 2; \
	if [ -z "$$paths" ]; then echo "no tests cover what differs from $(BASE)"; exit 0; fi; \
	echo "pytest $$paths"; \
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/pytest $(XDIST) $(if $(CHANGED_MARKS),-m "$(CHANGED_MARKS)") $$paths $(PYTEST_ARGS); \
	rc=$$?; [ $$rc -eq 5 ] && echo "(none of them outside CHANGED_MARKS)" && rc=0; exit $$rc

# `make test` with the per-file profile of tests/suite_profile.py: the table, the load, and the ids.
PROFILE_DIR ?= .suite-profile
test-profile: refresh
	rm -rf $(PROFILE_DIR) && mkdir -p $(PROFILE_DIR)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/pytest --collect-only -q | grep '::' > $(PROFILE_DIR)/ids.txt
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 SUITE_PROFILE_DIR=$(PROFILE_DIR) PYTHONPATH=tests $(VENV)/bin/pytest \
		-p suite_profile $(XDIST) --junitxml=$(PROFILE_DIR)/junit.xml $(PYTEST_ARGS); rc=$$?; \
	echo "rc=$$rc wall=$$(( $$(date +%s) - start )) s"; \
	$(PY) tests/suite_profile.py table $(PROFILE_DIR) --load "$$(cut -d' ' -f1-3 /proc/loadavg)"; exit $$rc

demo: refresh
	HF_HUB_OFFLINE=1 $(VENV)/bin/fleetrl demo --config examples/fleet.demo.yaml

# "Train your own model": build a local HF folder, tokenizer and chat prompts (no download), then run them.
demo-hf: refresh
	HF_HUB_OFFLINE=1 $(PY) -m fleetrl.demo.hf_inputs examples/hf
	HF_HUB_OFFLINE=1 $(VENV)/bin/fleetrl demo --config examples/fleet.hf.yaml

# "Multi-turn environments and tools": the same inputs with lookup-tool rows, episodes in a skyrl-gym environment.
demo-tools: refresh
	HF_HUB_OFFLINE=1 $(PY) -m fleetrl.demo.hf_inputs examples/tools --rows tools
	HF_HUB_OFFLINE=1 $(VENV)/bin/fleetrl demo --config examples/fleet.tools.yaml

# "Agents through an endpoint": an openai-SDK agent (a calculator tool) run against each worker's own endpoint.
demo-agent: refresh
	HF_HUB_OFFLINE=1 $(PY) -m fleetrl.demo.hf_inputs examples/agent --rows arithmetic
	HF_HUB_OFFLINE=1 $(VENV)/bin/fleetrl demo --config examples/fleet.agent.yaml

# ruff, mypy, then the structure (docs/architecture.md): the package layering as import-linter contracts
# (pyproject.toml), file sizes and file-level import circles (tools/structure.py). Each runs even when
# one before it failed, so one `make lint` shows every finding; it fails if any did. mypy and
# lint-imports run from /tmp so that `fleetrl` is the installed tree with its subpackages, not ./fleetrl.
lint: refresh
	@rc=0; \
	echo "ruff"; $(VENV)/bin/ruff check fleetrl broker hub rollout trainer regions tests bench tools || rc=1; \
	echo "mypy"; (cd /tmp && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache --python-executable $(CURDIR)/$(PY) -p fleetrl) || rc=1; \
	echo "lint-imports (pyproject.toml [tool.importlinter])"; (cd /tmp && $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml) || rc=1; \
	echo "tools/structure.py"; $(PY) tools/structure.py . || rc=1; \
	exit $$rc

# checkov pins an old boto3, so it lives in its own virtual environment.
lint-infra:
	test -x .venv-checkov/bin/checkov || { $(PYTHON) -m venv .venv-checkov && .venv-checkov/bin/pip install --quiet checkov; }
	BC_SKIP_MAPPING=TRUE .venv-checkov/bin/checkov -d infra/terraform --framework terraform --skip-download --compact --quiet \
		--skip-path '\.tftest\.hcl$$'  # terraform test files are not configuration (checkov cannot parse them)

clean:
	rm -rf $(VENV) .venv-checkov .pytest_cache .mypy_cache build *.egg-info
