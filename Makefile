# Every target sets up the local virtual environment itself (.venv), then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# On the CPU dev/CI machines torch==2.13.0 resolves to the local CPU wheel; override on GPU hosts.
TORCH  ?= torch==2.13.0

TARGET ?= examples/fixtures/code-target
DRAFT  ?= examples/fixtures/code-target-dflash-b16
PROMPT ?= import numpy as np\n\n\ndef softmax(x, axis=-1):
TOKENS ?= 96

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# External oracle for the tests: z-lab's PyPI reference, kept out of site-packages
	# (its `dflash` console script would shadow ours).
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/oracle dflash==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dflash generate --target $(TARGET) --draft $(DRAFT) \
		--prompt "$$(printf '$(PROMPT)')" --max-new-tokens $(TOKENS) --baseline

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
