"""What `kvtier serve --kv-events-config` costs the decode loop: the same offline batch on the serve engine with
and without its KV events (the device log + tiers' log drained, encoded and published by the publisher thread),
alternated, fresh engine per run. Usage: python scripts/kv_events_overhead.py [--model tiny|smollm2] [--runs 4]"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from kvtier.config import EngineConfig
from kvtier.engine import SamplingParams
from kvtier.events.publisher import KvEventsConfig
from kvtier.server import kv_events
from kvtier.server.cli import build_engine
from kvtier.server.config import ServeConfig
from kvtier.tiers.spec import parse_specs


def run(model: str, events: bool, seed: int, num_prompts: int, prompt_tokens: int,
        max_tokens: int) -> tuple[float, int]:
    engine_config = EngineConfig(device_kv_budget_bytes=64 << 20, block_tokens=16, max_num_seqs=num_prompts)
    config = ServeConfig(model=model, tiers=parse_specs(["dram:256MiB"]), engine=engine_config)
    _, engine, manager = build_engine(config)
    publisher = stats = None
    if events:
        endpoint = f"ipc://{tempfile.mkdtemp()}/events.sock"
        events_config = KvEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
        publisher, stats = kv_events.start(events_config, engine, manager)
    rng = random.Random(seed)
    vocab = min(engine.vocab_size, 256) if model == "tiny" else 20000
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(num_prompts)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    if publisher is not None:
        publisher.close()
        print(f"  events: {publisher.num_batches} batches, {stats.num_dropped} device events dropped")
    engine.close()
    manager.close()
    return seconds, sum(len(o) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.runs):
        for events in (False, True) if i % 2 == 0 else (True, False):
            seconds, tokens = run(args.model, events, i, args.prompts, args.prompt_tokens, args.max_tokens)
            times[events].append(seconds)
            print(f"run {i} events={'on' if events else 'off'}: {seconds:.3f} s, {tokens / seconds:.1f} tokens/s")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: off {off:.3f} s, on {on:.3f} s, on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
