# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	# A CPU build of torch first where no CUDA driver is present (a bare `torch` pulls GBs of CUDA).
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "torch>=2.4"; \
	else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e ".[train,dev]"
	touch $@

.PHONY: install demo test lint bench
install: $(BIN)/.installed

demo: install
	$(BIN)/tierstore train

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check tierstore trainer tools tests

bench: install
	$(BIN)/tierstore bench
