"""kvtier's block views against vLLM 0.32's own code, in `.venv-vllm` (`vllm_layouts_check.py`): caches made
by `create_kv_cache_views` in every block-compact `KVCacheLayout`, K and V written by vLLM's CPU kernel
(fp32 and both fp8 formats) and read by the GPU backends' split."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvtier.bench.servers import VLLM_PYTHON

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing: `make vllm` creates it"),
]
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def found() -> dict:
    script = Path(__file__).with_name("vllm_layouts_check.py")
    out = subprocess.run([str(VLLM_PYTHON), str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_check_ran_this_checkouts_kvtier(found):
    assert Path(found["kvtier"]).resolve() == (SRC / "kvtier" / "__init__.py").resolve()


def test_the_cpu_kernel_writes_what_the_planes_view_reads(found):
    """fp32: bit-exact (V as [H, T, D]; K transposed, [H, D, T], by the "vec" kernels: named in the key)."""
    assert found["cpu_layouts"] == ["LBHNC"]
    assert found["cpu_auto"] == {"isa": "vec", "view_dtype": "torch.float32", "rel_err_k_transposed": 0.0,
                                 "rel_err_v": 0.0, "untouched_zero": True}


@pytest.mark.parametrize("cache_dtype,view_dtype,max_rel_err", [("fp8", "torch.float8_e4m3fn", 0.125),
                                                                 ("fp8_e5m2", "torch.float8_e5m2", 0.25)])
def test_the_cpu_kernels_fp8_bytes_are_read_as_their_format(found, cache_dtype, view_dtype, max_rel_err):
    """Read as the wrong fp8 format (or as bytes of another order) the errors would be orders larger."""
    case = found["cpu_fp8"][cache_dtype]
    assert case["view_dtype"] == view_dtype and case["untouched_zero"]
    assert 0 < case["rel_err_k_transposed"] <= max_rel_err and 0 < case["rel_err_v"] <= max_rel_err


def test_the_gpu_backends_split_is_the_cells_view_in_every_layout(found):
    assert found["split"] == {"LBHNC": True, "LBNHC": True, "BLHNC": True, "BLNHC": True}


def test_an_mla_cache_is_one_latent_row_per_token(found):
    assert found["mla_shape"] == {"LBHNC": [5, 1, 32, 576], "BLNHC": [5, 1, 32, 576]}
