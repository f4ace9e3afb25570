# The two commands a newcomer needs: `make demo` and `make test`. Both build the venv first.
# `make check` is the fast tier for development: lint, types and the unit tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint venv redis bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gateway demo

redis:
	bash .ci/redis-up

lint: $(STAMP)
	$(BIN)/ruff check gateway routing tiers tests bench
	$(BIN)/ruff format --check gateway routing tiers tests bench
	$(BIN)/mypy

test: $(STAMP) redis lint
	$(BIN)/python -m pytest -q

# The unit tests: only Python and the redis-server they start themselves. Not tests/e2e (the
# gateway's processes), tests/realworkers (real inference servers), tests/helm (helm), nor the
# tests marked slow (pyproject.toml `markers`).
UNIT := --ignore=tests/e2e --ignore=tests/realworkers --ignore=tests/helm -m "not slow"
check: $(STAMP) redis lint
	$(BIN)/python -m pytest -q $(UNIT) tests

# The overhead benchmark (not part of `make test`): needs wrk and nginx from Debian's packages.
# BENCH_BASELINE: the gateway it is compared with, run in the same rounds (issue 14's "previous
# main": main's HEAD when the comparison was built, 2026-12-01).
BENCH_BASELINE ?= f388856ac4c73f2af5fe039ef2b83c3b9cc808da
bench: $(STAMP) redis
	@command -v wrk >/dev/null && command -v nginx >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq wrk nginx-light >/dev/null)
	$(BIN)/python bench/overhead.py --baseline $(BENCH_BASELINE)
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/budgets.py

clean:
	rm -rf $(VENV) build *.egg-info
