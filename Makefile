# The two commands a newcomer needs: `make demo` and `make test`. Both build the venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv redis bench clean

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

# The overhead benchmark (not part of `make test`): needs wrk and nginx from Debian's packages.
bench: $(STAMP) redis
	@command -v wrk >/dev/null && command -v nginx >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq wrk nginx-light >/dev/null)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
