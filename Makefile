# manylora: `make serve` (environment + embedded default model + Triton server), `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
STAMP      := $(VENV)/.manylora-installed

DEFAULT_DIR  := build/default
BASE_MODEL   ?=
ADAPTERS     ?=
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT  ?= 9000
TEST_WORKERS ?= 3

# Engine knobs (empty: the engine's default); passed to the generator's config.pbtxt.
DEVICE                 ?=
DTYPE                  ?=
MAX_LORA_RANK          ?=
MAX_LORAS              ?=
MAX_CPU_LORAS          ?=
MAX_NUM_SEQS           ?=
MAX_NUM_BATCHED_TOKENS ?=
MAX_MODEL_LEN          ?=
PAGE_SIZE              ?=
NUM_KV_PAGES           ?=
GPU_MEMORY_FRACTION    ?=
MAX_QUEUE_SIZE         ?=
TENSOR_PARALLEL_SIZE   ?=
STREAM_INTERVAL_MS     ?=

ENGINE_PARAMS := \
  --param device=$(DEVICE) --param dtype=$(DTYPE) --param max_lora_rank=$(MAX_LORA_RANK) \
  --param max_loras=$(MAX_LORAS) --param max_cpu_loras=$(MAX_CPU_LORAS) --param max_num_seqs=$(MAX_NUM_SEQS) \
  --param max_num_batched_tokens=$(MAX_NUM_BATCHED_TOKENS) --param max_model_len=$(MAX_MODEL_LEN) \
  --param page_size=$(PAGE_SIZE) --param num_kv_pages=$(NUM_KV_PAGES) \
  --param gpu_memory_fraction=$(GPU_MEMORY_FRACTION) --param max_queue_size=$(MAX_QUEUE_SIZE) \
  --param tensor_parallel_size=$(TENSOR_PARALLEL_SIZE) --param stream_interval_ms=$(STREAM_INTERVAL_MS)

# With BASE_MODEL given, the embedded default is neither built nor used.
ifeq ($(strip $(BASE_MODEL)),)
SERVE_DEPS     := default-model
SERVE_MODEL    := --base-model $(DEFAULT_DIR)/base --adapters $(or $(ADAPTERS),$(DEFAULT_DIR)/catalogue.json)
else
SERVE_DEPS     :=
SERVE_MODEL    := --base-model $(BASE_MODEL) --adapters "$(ADAPTERS)"
endif

.PHONY: help venv default-model serve test lint format clean

help:
	@echo "make serve    environment + embedded default model + Triton server on :$(HTTP_PORT)/:$(GRPC_PORT)"
	@echo "              and the OpenAI-compatible front on :$(OPENAI_PORT) (OPENAI_PORT= to leave it off)"
	@echo "              (BASE_MODEL=<hf dir> ADAPTERS=<catalogue.json> to serve your own; engine knobs:"
	@echo "               DEVICE DTYPE MAX_LORA_RANK MAX_LORAS MAX_CPU_LORAS MAX_NUM_SEQS PAGE_SIZE ...)"
	@echo "make test     the whole test suite (end-to-end against the real server included) + ruff"
	@echo "make lint     ruff"
	@echo "make default-model   build the embedded default into $(DEFAULT_DIR)"

venv: $(STAMP)

# torch first, pinned, so that the extras' requirements do not pull another build of it; then manylora with its
# extras (pyproject.toml) at the versions the tests were run with; the server apart (its own requirements are
# pytriton's Python API, which nothing here uses)
$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install --no-cache-dir --upgrade pip
	$(PIP) install --no-cache-dir torch==2.13.0
	$(PIP) install --no-cache-dir -e ".[dev,bench,openai]" torch==2.13.0 numpy==1.26.4 transformers==5.24.0 peft==0.21.2
	$(PIP) install --no-cache-dir --no-deps nvidia-pytriton==0.7.0
	@touch $@

default-model: venv
	$(PY) -m manylora.embedded.build --out $(DEFAULT_DIR)

serve: venv $(SERVE_DEPS)
	$(PY) scripts/serve.py $(SERVE_MODEL) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	  --metrics-port $(METRICS_PORT) --openai-port $(or $(OPENAI_PORT),0) $(ENGINE_PARAMS)

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
	$(VENV)/bin/ruff check .

lint: venv
	$(VENV)/bin/ruff check .

format: venv
	$(VENV)/bin/ruff format .

clean:
	rm -rf build .pytest_cache .ruff_cache
