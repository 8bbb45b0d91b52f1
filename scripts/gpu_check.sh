#!/usr/bin/env bash
# `make gpu-check`: the GPU paths on a CUDA machine, in one run under 10 minutes.
# 1. the connector worker's CUDA copies (side stream, pinned buffers, per-layer events), bit-exact, and the
#    engine's offload fetch (side stream from the pinned DRAM slots: exact and sparse == the reference,
#    halves never overwritten while read, no host sync on the way): needs only torch;
# 2. vLLM's CUDA build (pip install vllm==0.32.0, or KVTIER_VLLM_WHEEL=path) and then
#    `kvtier bench vllm --systems vllm,vllm-kvtier-dram` and vLLM's native `--kv-offloading-size`.
# A machine that cannot install vLLM (no network) runs step 1 and says so for step 2.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
$PY -m pip install -q --no-deps -e . 2>/dev/null || true
timeout 240 $PY -m pytest -q -p no:cacheprovider --timeout=200 tests/integrations/test_vllm_cuda.py \
  tests/integrations/test_vllm_layouts.py -k "not services" 2>&1 | tee "$OUT/connector-tests.log"
status=${PIPESTATUS[0]}
timeout 120 $PY -m pytest -q -p no:cacheprovider --timeout=100 tests/engine/test_offload.py -k cuda -rs \
  2>&1 | tee "$OUT/offload-tests.log"
offload_status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] && status=$offload_status
if ! $PY -c "import vllm" 2>/dev/null; then
  $PY -m pip install -q ${KVTIER_VLLM_WHEEL:-vllm==0.32.0} 2>&1 | tail -3 | tee "$OUT/vllm-install.log"
fi
if ! $PY -c "import vllm" 2>/dev/null; then
  echo "gpu-check: vLLM's CUDA build is not installed here (no network, no KVTIER_VLLM_WHEEL): the bench steps are skipped"
  exit $status
fi
export KVTIER_VLLM_PYTHON=$(command -v $PY)
timeout 240 $PY -m kvtier.cli bench vllm --systems vllm,vllm-kvtier-dram --users 4 --turns 2 --log-dir "$OUT/bench" \
  2>&1 | tee "$OUT/bench.log"
# vLLM's own CPU offloading for comparison: one request pair on the same model
timeout 120 $PY - <<'PYEOF' 2>&1 | tee "$OUT/native-offload.log"
import time, pathlib
from kvtier import models
from kvtier.testing.vllm import VllmServer
model = models.cache_dir() / "smollm2-135m-instruct"
with VllmServer(model, pathlib.Path("native.log"), extra_args=("--kv-offloading-size", "2")) as s:
    prompt = open(models.cache_dir() / "smollm2-135m-instruct" / "config.json").read() * 8
    for i in range(2):
        start = time.perf_counter(); s.complete(prompt, max_tokens=1); print(f"native offload request {i}: {time.perf_counter() - start:.3f} s")
PYEOF
exit $status
