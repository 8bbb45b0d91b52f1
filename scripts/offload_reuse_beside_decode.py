"""Does reusing an offloaded prefix from the SSD stall the requests already running? (issue 21; docs/benchmarks/long-context.md,
"An offloaded prefix from the SSD, loaded off the step thread").

SmolLM2, a 1,024-token device budget with exact offload, DRAM + SSD tiers. The first run of a directory
computes a long prompt onto it (write-through); every later run is a fresh process (new DRAM, the same SSD
directory, page-cache warm): a short request decodes, then the long one arrives and reuses its prefix from the
SSD. Prints, as JSON: the short request's tokens and longest step while the long one waits for its KV, the long
one's TTFT and cached tokens, the first steps' times. Compare two commits by pointing PYTHONPATH at their src:

    .venv/bin/python scripts/offload_reuse_beside_decode.py /tmp/ssd-8k 8100           # computes the prefix once
    .venv/bin/python scripts/offload_reuse_beside_decode.py /tmp/ssd-8k 8100           # this tree
    PYTHONPATH=/tmp/old/src .venv/bin/python scripts/offload_reuse_beside_decode.py /tmp/ssd-8k 8100
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvtier import models
from kvtier.codecs import get_codec
from kvtier.data import shared_data_file
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import build_manager

BLOCK = 64


def main(ssd_dir: Path, num_tokens: int) -> None:
    loaded = models.load("smollm2")
    layout = loaded.kv_layout(BLOCK)
    ids = loaded.tokenizer(shared_data_file("tinyshakespeare.txt").read_text()[:400_000])["input_ids"]
    long_prompt, short_prompt = ids[:num_tokens], ids[50_000:50_192]
    slot = get_codec("raw").max_encoded_bytes(layout)
    first = not ssd_dir.exists()
    ssd_dir.mkdir(parents=True, exist_ok=True)
    manager = build_manager([f"dram:{(num_tokens // BLOCK + 64) * slot}", f"ssd:{ssd_dir}:4GiB"], slot_bytes=slot)
    config = EngineConfig(device_kv_budget_bytes=1024 * layout.bytes_per_token, block_tokens=BLOCK,
                          kv_offload="exact", offload_fetch_blocks=15, max_num_seqs=4)
    engine = LLMEngine(loaded, config, manager)
    if first:
        start = time.perf_counter()
        engine.generate([long_prompt], SamplingParams(max_tokens=2))
        print(f"computed the {num_tokens}-token prefix onto {ssd_dir} in {time.perf_counter() - start:.1f} s; "
              "run again to measure")
    else:
        print(json.dumps(measure(engine, long_prompt, short_prompt)))
    engine.close()
    manager.flush()
    manager.close()


def measure(engine: LLMEngine, long_prompt: list[int], short_prompt: list[int]) -> dict:
    engine.add_request("short", short_prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    num_short = 0
    while num_short < 8:  # the short request is decoding
        num_short += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "short")
    steps: list[tuple[float, int]] = []  # (ms, short tokens)
    num_waiting = ttft = cached = None
    added = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        steps.append((round((time.perf_counter() - start) * 1000, 1),
                      sum(len(o.new_token_ids) for o in outputs if o.request_id == "short")))
        for o in outputs:
            if o.request_id == "long" and o.new_token_ids and ttft is None:
                ttft, cached, num_waiting = time.perf_counter() - added, o.cached_tokens_by_tier, len(steps) - 1
    waiting = steps[:num_waiting]  # the steps before the one that computes the long request's tail
    return {"short_tokens_while_long_loads": sum(n for _, n in waiting),
            "longest_step_ms_while_long_loads": max((ms for ms, _ in waiting), default=0.0),
            "long_ttft_s": round(ttft, 3), "long_cached_tokens": cached, "first_steps_ms": [ms for ms, _ in steps[:8]]}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
