# The two commands a newcomer needs: `make demo` and `make test`. Both build the venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv redis clean

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

clean:
	rm -rf $(VENV) build *.egg-info
