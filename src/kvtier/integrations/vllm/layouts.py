"""Where K and V (or MLA's latent) sit in the KV cache vLLM hands the connector, and kvtier's view of it.

vLLM 0.32 allocates each attention layer as a logical `[B, H, N, C]` view over one buffer (RFC #42082:
`kv_cache_interface.create_kv_cache_views`); its strides follow the resolved `KVCacheLayout` (LBHNC:
head-major, "HND"; LBNHC: token-major, "NHD"; BLHNC / BLNHC: blocks outermost, a block's layers side by
side), and C is a cell's content, `head_size + head_size_v` elements. The shape alone does not say where K
and V are: each backend reads the content its own way, so the page format comes from the backend's name:

- `planes` (CPU_ATTN): a block's head plane `[N, 2D]` is read as `[2N, D]`, N key rows then N value rows
  (`cpu_attn.py`: `kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)`); needs (N, C) contiguous per head;
- `cells` (FLASH_ATTN, FLASHINFER, TRITON_ATTN): each (head, token) cell is K then V
  (`kv_cache.transpose(1, 2).split(D, dim=-1)`), in any physical order;
- `halves`: the pre-RFC split page `[B, 2, N, H, D]` (K half, V half), as vLLM's offloading connector
  still recognizes it;
- `latent` (MLA backends): `[B, 1, N, C]`, one latent row per token.

`block_view` turns any of them into one strided view `[B, 2, H, T, D]` (MLA: `[B, 1, 1, T, D]`) of the
same memory, no copy, in the layout's dtype (fp8 caches, uint8 in vLLM, are viewed as their fp8 format).
Inside the K and V halves the bytes are the backend's: the GPU backends' cells give K and V as [H, T, D]
each (kvtier's own order, `KVLayout.page` ""), but vLLM's CPU kernels pack K per ISA (K transposed,
[H, D, T], for "vec"), so on the CPU platform `engine_page` names the kernel and its ISA in the key
("cpu_attn:vec"): two engines share a block only when their bytes mean the same KV. Anything else is
refused at start (fail closed), never guessed.
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout

BACKEND_FORMATS = {"CPU_ATTN": "planes", "FLASH_ATTN": "cells", "FLASHINFER": "cells", "TRITON_ATTN": "cells"}
PAGE_FORMATS = ("planes", "cells", "halves", "latent")
# vLLM's --kv-cache-dtype -> the format its bytes hold (vLLM's tensor is uint8 for all of them)
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def engine_page(vllm_config) -> str:
    """The `KVLayout.page` of this engine's blocks, known in every process (the scheduler's too) before any
    cache exists: vLLM's CPU kernels' own bytes on its CPU platform, kvtier's [H, T, D] halves elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model.use_mla:
        return "cpu_mla"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return "cpu_attn:" + _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)


def page_format(backend_name: str, layout: KVLayout) -> str:
    """The page format of the layers the attention backend `backend_name` serves; raises ValueError for a
    backend whose bytes are not the ones `layout.page` names in the keys."""
    if layout.latent:
        # every MLA backend with one state per token stores one latent row per token
        fmt, ok = "latent", layout.page == ("cpu_mla" if backend_name == "CPU_MLA" else "")
    elif backend_name not in BACKEND_FORMATS:
        raise ValueError(f"KvtierConnector does not know where attention backend {backend_name} keeps K and V "
                         f"(it knows {sorted(BACKEND_FORMATS)}); choose one with --attention-backend")
    else:
        fmt = BACKEND_FORMATS[backend_name]
        ok = layout.page.startswith("cpu_attn:") if fmt == "planes" else layout.page == ""
    if not ok:
        raise ValueError(f"attention backend {backend_name} holds {fmt} pages, but the keys name page "
                         f"{layout.page!r}: the scheduler expected another backend")
    return fmt


def kv_dtype(cache_dtype: str, model_dtype: str) -> str:
    """The KV format named in keys: the model's dtype for `--kv-cache-dtype auto`, else the fp8 format."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"KvtierConnector supports --kv-cache-dtype auto, {', '.join(FP8_CACHE_DTYPES)}; "
                         f"got {cache_dtype}")
    return FP8_CACHE_DTYPES[cache_dtype]


def block_view(kv_cache: torch.Tensor, page: str, layout: KVLayout) -> torch.Tensor:
    """A view `[num_blocks, 2, H, T, D]` (MLA: `[num_blocks, 1, 1, T, D]`) of one layer's cache, in the
    layout's dtype; raises ValueError when the tensor is not what `page` and `layout` say."""
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    dtype = getattr(torch, layout.dtype)
    if kv_cache.element_size() != dtype.itemsize:
        raise ValueError(f"KV cache layer of {kv_cache.dtype} does not hold {layout.dtype}")
    kv = kv_cache.view(dtype) if kv_cache.dtype != dtype else kv_cache  # uint8 -> its fp8 format
    if page == "halves":
        _expect(kv, (kv.shape[0], 2, T, H, D), page)
        return kv.permute(0, 1, 3, 2, 4)
    C = layout.num_parts * D
    _expect(kv, (kv.shape[0], H, T, C), page)
    if kv.stride(3) != 1:
        raise ValueError(f"KV cache layer strides {kv.stride()}: a cell's content is not contiguous")
    if page == "latent":
        return kv.unsqueeze(1)
    if page == "cells":
        return kv.unflatten(3, (2, D)).permute(0, 3, 1, 2, 4)
    if page == "planes":
        if kv.stride(2) != C:
            raise ValueError(f"KV cache layer strides {kv.stride()}: CPU_ATTN reads a head's tokens contiguous")
        num_blocks, (block_stride, head_stride) = kv.shape[0], kv.stride()[:2]
        planes = kv.as_strided((num_blocks, H, 2, T, D), (block_stride, head_stride, T * D, D, 1))
        return planes.transpose(1, 2)
    raise ValueError(f"unknown page format {page!r}: one of {PAGE_FORMATS}")


def _expect(kv: torch.Tensor, shape: tuple[int, ...], page: str) -> None:
    if tuple(kv.shape) != shape:
        raise ValueError(f"KV cache layer shape {tuple(kv.shape)} is not the {page} page {list(shape)}: "
                         "a kernel block size other than --block-size, or another model's cache")
