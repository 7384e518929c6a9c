# Two commands do all the set-up on a fresh machine with Python 3.10-3.13 and pip:
#   make demo   runs the main job (a small ablation sweep on the synthetic backend, W&B offline)
#   make test   runs the tests (fast tier); make test-slow adds the slow tier
# Each creates and fills .venv on first use. torch comes first, pinned to the CPU wheel, so that
# no later requirement can pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-verl test-verl-e2e test-wheel docs docs-figures bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ablate sweeps=smoke
	$(BIN)/python -m ablate.analysis runs/smoke --reps 1000

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadgroup --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n 2 --dist loadgroup --durations=25 || test $$? -eq 5  # 5: no slow test collected

test-verl:
	bash .ci/verl-env.sh
	.venv-verl/bin/python -m pytest -q --durations=15 tests/verl_tier

test-verl-e2e:
	bash .ci/verl-env.sh
	.venv-verl/bin/python -m pytest -q -s --durations=15 tests/verl_e2e

test-wheel:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash .ci/wheel-smoke.sh

docs:
	PYTHON=$(PYTHON) bash .ci/docs.sh

# Every output README.md and docs/ quote, run again at the current (committed) code: about 20 minutes
# alone on 2 cores, most of it the budget_selection sweep (docs/development.md gives the times measured;
# docs/regenerate_quotes.py says how to run less).
docs-figures: $(STAMP)
	$(BIN)/python docs/regenerate_quotes.py

bench: $(STAMP)
	$(BIN)/python bench/bench_policies.py
	$(BIN)/python bench/bench_sweep_overhead.py
	$(BIN)/python bench/bench_cli_latency.py
	$(BIN)/python bench/calibrate_synthetic.py

clean:
	rm -rf $(VENV) .venv-verl .venv-docs
