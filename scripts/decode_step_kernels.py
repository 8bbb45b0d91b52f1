"""Where an engine decode step's time goes, and the two CPU kernels' side of it (issue 33).

Three measurements, each alternated over rounds, best (and median) reported:
- `linear`: SmolLM2's per-layer weight shapes (q, k, v, o, gate, up, down of 30 layers, distinct buffers:
  425 MB, out of every cache) multiplied by M = 1, 2, 4, 8 rows through torch's `linear` and through kvtier's
  few-rows kernel (`engine/cpu_linear.py`), and a plain `sum` of the same weights (what reading them costs).
- `prefill`: one sequence's prefill chunk (Q queries at a C-token context, 3 KV heads x 3, head dim 64, 64-token
  blocks scattered in an arena) through the paged kernel vs gathered + SDPA (`attention.GATHER_MIN_QUERIES`'s
  question), fp32 and bf16 KV.
- `step`: an 8k-token SmolLM2 request all on the device, its decode steps' wall time and torch's profiler per op.

    python scripts/decode_step_kernels.py linear prefill step
    PYTHONPATH=/tmp/wt-old/src python scripts/decode_step_kernels.py step   # another commit, side by side
    KVTIER_CPU_LINEAR=0 python scripts/decode_step_kernels.py step          # torch's linear in the engine
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, G, D, T = 3, 3, 64, 64  # SmolLM2: KV heads, query heads per KV head, head dim; block tokens


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def linear(rounds: int) -> None:
    from kvtier.engine import cpu_linear as frl

    assert frl.available(), "the few-rows kernel could not be built"
    torch.manual_seed(0)
    d, kv, ff = 576, 192, 1536
    weights = [w for _ in range(30) for w in (torch.randn(d, d), torch.randn(kv, d), torch.randn(kv, d),
                                              torch.randn(d, d), torch.randn(ff, d), torch.randn(ff, d),
                                              torch.randn(d, ff))]
    nbytes = sum(w.nbytes for w in weights)
    read = best(lambda: [w.sum() for w in weights], rounds)
    print(f"{nbytes / 1e6:.0f} MB of weights; a plain sum reads them at {nbytes / read / 1e9:.1f} GB/s")
    for m in (1, 2, 4, 8):
        xs = {k: torch.randn(m, k) for k in (d, ff)}
        res = {"torch": [], "kernel": []}
        for _ in range(rounds):  # alternated
            res["torch"].append(best(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], 1))
            res["kernel"].append(best(lambda: [frl.few_rows_linear(xs[w.shape[1]], w) for w in weights], 1))
        t, k = min(res["torch"]), min(res["kernel"])
        print(f"M={m}: torch linear {t * 1e3:6.2f} ms ({nbytes / t / 1e9:4.1f} GB/s)   kernel {k * 1e3:6.2f} ms "
              f"({nbytes / k / 1e9:4.1f} GB/s)   {t / k:.2f}x")


def prefill(rounds: int) -> None:
    from kvtier.engine import paged_kernel

    assert paged_kernel.available(), "the paged kernel could not be built"
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for ctx, nq in ((8176, 128), (8176, 512), (2048, 256), (1024, 512), (512, 512), (1024, 64), (8176, 64)):
            nb, arena = -(-ctx // T), 600
            k, v = torch.randn(arena, H, T, D).to(dtype), torch.randn(arena, H, T, D).to(dtype)
            table = torch.randperm(arena)[:nb]
            q = torch.randn(nq, H * G, D)
            out = torch.empty_like(q)
            lens = [torch.tensor([x]) for x in (ctx, 0, nq)]
            mask = torch.arange(ctx - nq, ctx)[:, None] >= torch.arange(ctx)[None]

            def kernel():
                paged_kernel.paged_attention(out, q, k, v, table[None], lens[0], lens[1], lens[2], D ** -0.5)

            def gathered():  # the old path: the context gathered at full precision, SDPA with the causal offset
                keys = k.index_select(0, table).transpose(0, 1).reshape(H, nb * T, D)[:, :ctx].float()
                values = v.index_select(0, table).transpose(0, 1).reshape(H, nb * T, D)[:, :ctx].float()
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                                      attn_mask=mask, enable_gqa=True)

            res = {"kernel": [], "gathered": []}
            for _ in range(rounds):
                res["kernel"].append(best(kernel, 1))
                res["gathered"].append(best(gathered, 1))
            err = (gathered()[0].transpose(0, 1) - out).abs().max().item()
            kt, gt = min(res["kernel"]), min(res["gathered"])
            print(f"{str(dtype)[6:]:8s} context {ctx:5d}, {nq:3d} queries: kernel {kt * 1e3:7.3f} ms   gather + SDPA "
                  f"{gt * 1e3:7.3f} ms   {gt / kt:.2f}x   max |diff| {err:.1e}")


def step(rounds: int, tokens: int = 8000, steps: int = 40) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kvtier import models
    from kvtier.data import shared_data_file
    from kvtier.engine import EngineConfig, LLMEngine, SamplingParams

    loaded = models.load("smollm2")
    ids = loaded.tokenizer(shared_data_file("tinyshakespeare.txt").read_text()[: tokens * 6])["input_ids"][:tokens]
    layout = loaded.kv_layout(64)
    engine = LLMEngine(loaded, EngineConfig(device_kv_budget_bytes=(tokens // 64 + 4) * layout.block_bytes,
                                            block_tokens=64, max_num_seqs=1, prefix_caching=False))
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=steps + 2))
    start = time.perf_counter()
    while not any(out.new_token_ids for out in engine.step()):
        pass  # the prefill
    ttft = time.perf_counter() - start
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    engine.close()
    times.sort()
    print(f"{tokens}-token prompt: TTFT {ttft:.2f} s; {len(times)} decode steps: median "
          f"{times[len(times) // 2] * 1e3:.1f} ms, best {times[0] * 1e3:.1f} ms")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]:
        print(f"  {e.key[:48]:48s} {e.self_cpu_time_total / 1e3 / len(times):7.2f} ms per step, "
              f"{e.count / len(times):5.1f} calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="+", choices=["linear", "prefill", "step"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for what in args.what:
        {"linear": linear, "prefill": prefill, "step": step}[what](args.rounds)


if __name__ == "__main__":
    main()
