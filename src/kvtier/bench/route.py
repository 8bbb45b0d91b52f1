"""`kvtier bench route`: the chat workload (users whose sessions come back) across 2 replicas of vLLM +
kvtier behind a router, each replica on the same small device budget, side by side per routing policy:

- `round-robin`: `kvtier route --policy round-robin`;
- `sglang`: SGLang's cache-aware router (PyPI `sglang-router`, `python -m sglang_router.launch_router
  --policy cache_aware`): an approximate radix tree of the prompts it routed, no events;
- `dynamo`: `kvtier route --policy dynamo`, NVIDIA Dynamo's selection service (`.venv-dynamo`) fed by the
  replicas' KV events (vLLM's device blocks and kvtier's tiers), through `--shared-pool` with a pool;

each with local tiers only (`local`: a `shm:` tier per replica) and with a shared pool (`pool`: the same
`shm:` tier above one Redis both replicas use). A fresh cluster (and pool) per system, so no run starts warm.
The reference is one vLLM replica alone replaying the same conversations (fp32, greedy, EOS ignored): every
routed reply must equal its. Reported per system: TTFT p50 / p90, prompt tokens computed vs loaded per tier
(vLLM's device prefix cache, kvtier's tiers; from each replica's /metrics), requests per replica, the
prefix-hit rate, and what `kvtier simulate`'s router models predict for it (`sim/`: the reference's prompts
in the order and at the times that run sent them, at the prefill speed its replicas measured). `--kill`: after
each system's run the same conversations again, replica 2 killed (SIGKILL) once a quarter of them are
answered: requests lost (the client's retry failed too) and those cut mid-stream (in flight on the killed
replica: no router can resume a stream it already began).

Two knobs make the routers' differences show: `--tier-blocks N` bounds each replica's `shm:` tier to N blocks,
so kvtier evicts (and announces each block `BlockRemoved`, which Dynamo's index drops and SGLang's tree never
learns); `--shared-prefix-chars N` puts the same N characters (instructions all users share) before each
user's passage. Per system the bench also counts the blocks each replica announced stored and removed (its
KV event stream, per medium), the returning turns that moved replica, and, before any system runs, the
floor: the prompt tokens one cache that never evicts would compute (each prompt block once).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench.harness import SYSTEM_PROMPT, SystemResult, TurnClock, Workload, _pct, conversations
from kvtier.sim.router import dynamo_scale

POLICIES = ("round-robin", "sglang", "dynamo")  # and dynamo:S, Dynamo with prefill_load_scale S
SETUPS = ("local", "pool")
SHM_BYTES = "1GiB"        # per replica by default: the workload never fills it (the device budget is the pressure)
POOL_MAXMEMORY = "1gb"
REFERENCE = "reference"   # one vLLM replica alone
KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M in fp32


def shm_spec(directory: Path, tier_blocks: int = 0) -> str:
    """A replica's `shm:` tier holding `tier_blocks` blocks of 32 tokens (a block's file: its payload plus a header
    and layer table of under 4 KiB, the size the tier's index counts), or, with 0, `SHM_BYTES` (never full)."""
    from kvtier.bench.servers import BLOCK_TOKENS

    block_file = BLOCK_TOKENS * KV_BYTES_PER_TOKEN + 4096
    return f"shm:{directory}:{tier_blocks * block_file if tier_blocks else SHM_BYTES}"


def shared_prefix(text: str, chars: int) -> str:
    """What every user's system prompt carries before their passage: the text's last `chars` characters
    (instructions a deployment gives every conversation); empty for 0."""
    return text[-chars:] if chars > 0 else ""
# `kvtier simulate`'s router model for each policy (`sim/router.py`)
SIM_ROUTERS = {"round-robin": "round-robin", "sglang": "cache-aware", "dynamo": "dynamo"}


def _sim_router(policy: str) -> str:
    return policy if dynamo_scale(policy) is not None else SIM_ROUTERS[policy]


@dataclass(slots=True)
class RouteResult(SystemResult):
    num_cut: int = 0  # streams that broke after their first token (in flight on a killed replica), retried
    texts: dict = field(default_factory=dict)  # (user, turn) -> the reply's text (what the next turn carries)
    routed: dict = field(default_factory=dict)  # (user, turn) -> the replica that answered (kvtier route says)
    usage: dict = field(default_factory=dict)  # (user, turn) -> (prompt tokens, cached tokens) its replica reported


def system_names(policies=POLICIES, setups=SETUPS) -> list[str]:
    return [f"{policy}/{setup}" for setup in setups for policy in policies]


# -- the client -----------------------------------------------------------------------------------------

async def _chat_turn(client, result: RouteResult, key, messages: list[dict], w: Workload,
                     prompts: dict | None) -> str | None:
    """One streamed greedy chat completion; TTFT and gaps into `result`; its text, None on failure (one
    retry: a stream the killed replica cut)."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": w.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    from kvtier.route.app import REPLICA_HEADER

    for attempt in range(2):
        clock, text, tokens, prompt_ids = TurnClock(), [], [], None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                result.routed[key] = reply.headers.get(REPLICA_HEADER, "")
                if reply.status_code != 200:
                    raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}")
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    prompt_ids = prompt_ids or chunk.get("prompt_token_ids")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        result.num_prompt_tokens += usage.get("prompt_tokens", 0)
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        result.usage[key] = (usage.get("prompt_tokens", 0), cached)
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content or choice.get("token_ids"):
                            clock.tick()
                            text.append(content or "")
                            tokens += choice.get("token_ids") or []
            if len(tokens) < w.max_tokens and not text:
                raise RuntimeError("the stream ended without tokens")
        except Exception as exc:  # noqa: BLE001 - counted; the other users go on
            if clock.ttft is not None and attempt == 0:
                result.num_cut += 1
            if attempt == 1:
                result.fail(exc)
                return None
            continue
        out = "".join(text)
        result.turns[key] = clock.turn(tokens, result.t0)
        result.texts[key] = out
        if prompts is not None and prompt_ids:
            prompts[key] = prompt_ids
        return out
    return None


def _run_chat(url: str, convs, w: Workload, name: str, *, kill=None, prompts: dict | None = None,
              preamble: str = "") -> RouteResult:
    """Every user's conversation, users at once, turns in order; `kill()` once a quarter of the requests
    are answered; `preamble`: text every user's system prompt carries before the passage. Progress on stderr."""
    import httpx

    result = RouteResult(name=name, wall_s=0.0)
    total = len(convs) * w.num_turns
    kill_at = max(1, total // 4) if kill is not None else None

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
            async def user(u: int, passage: str, user_messages: list[str]) -> None:
                context = f"{preamble}\n\n{passage}" if preamble else passage
                messages = [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{context}"}]
                for turn, message in enumerate(user_messages):
                    messages.append({"role": "user", "content": message})
                    text = await _chat_turn(client, result, (u, turn), list(messages), w, prompts)
                    done = len(result.turns) + result.num_failed
                    print(f"\r  {name}: {done}/{total} requests", end="", file=sys.stderr, flush=True)
                    if kill_at is not None and done == kill_at:
                        kill()
                    if text is None:
                        return
                    messages.append({"role": "assistant", "content": text})

            await asyncio.gather(*(user(u, p, m) for u, (p, m) in enumerate(convs)))

    start = time.perf_counter()
    asyncio.run(main())
    print(file=sys.stderr)
    result.wall_s = time.perf_counter() - start
    return result


# -- the replicas and the routers ------------------------------------------------------------------------

class Replicas:
    """2 vLLM + kvtier replicas (`shm:` tier each, of `tier_blocks` blocks if not 0, then the pool `pool_spec`
    if given), each on `num_blocks` device blocks and pinned to a core of its own, publishing KV events on
    `ipc://` sockets."""

    def __init__(self, model_dir: Path, root: Path, *, num_blocks: int, pool_spec: str | None, num: int = 2,
                 tier_blocks: int = 0) -> None:
        from kvtier.bench.servers import BLOCK_TOKENS, VllmServer, kvtier_transfer_config

        self.shm_dirs, self.servers, self.events, self.replays = [], [], [], []
        for i in range(num):
            shm = Path(tempfile.mkdtemp(prefix="kvtier-bench-route-", dir="/dev/shm"))
            self.shm_dirs.append(shm)
            tiers = [shm_spec(shm, tier_blocks)] + ([pool_spec] if pool_spec else [])
            self.events.append(f"ipc://{root}/r{i + 1}-events.sock")
            self.replays.append(f"ipc://{root}/r{i + 1}-replay.sock")
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events[-1],
                      "replay_endpoint": self.replays[-1]}
            self.servers.append(VllmServer(
                model_dir, root / f"r{i + 1}.log", kv_transfer=kvtier_transfer_config(tiers),
                max_model_len=(num_blocks - 1) * BLOCK_TOKENS,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())},
                extra_args=("--num-gpu-blocks-override", str(num_blocks), "--enable-prompt-tokens-details",
                            "--kv-events-config", json.dumps(config))))

    def __enter__(self) -> Replicas:
        from concurrent.futures import ThreadPoolExecutor

        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:  # both engines start at once
                list(pool.map(lambda s: s.__enter__(), self.servers))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.stop()
        for shm in self.shm_dirs:
            shutil.rmtree(shm, ignore_errors=True)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def kill(self, i: int) -> None:
        """SIGKILL replica `i`'s process group: a crash, not a drain."""
        proc = self.servers[i].proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


class EventCounter:
    """Subscribes to each replica's KV event stream (vLLM's ZMQ PUB, msgpack `KVEventBatch`) and counts the blocks
    it announced: `counts[i]` is {"stored" | "removed": {medium: blocks}} for replica i. What a router fed by
    the events learns; SGLang's router learns none of it."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = list(endpoints)
        self.counts: list[dict[str, dict[str, int]]] = [{"stored": {}, "removed": {}} for _ in endpoints]
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-bench-events", daemon=True)

    def __enter__(self) -> EventCounter:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def add(self, i: int, payload: bytes) -> None:
        """Count one batch `payload` ([ts, events, dp_rank]) of replica i."""
        import msgpack

        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for event in batch[1]:
            kind = {"BlockStored": "stored", "BlockRemoved": "removed"}.get(
                event.get("type") if isinstance(event, dict) else None)
            if kind is not None:
                medium = str(event.get("medium"))
                counts = self.counts[i][kind]
                counts[medium] = counts.get(medium, 0) + len(event.get("block_hashes") or [])

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        subs = []
        for endpoint in self.endpoints:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(endpoint)
            subs.append(sub)
        self._ready.set()
        poller = zmq.Poller()
        for sub in subs:
            poller.register(sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    try:
                        self.add(subs.index(sock), frames[-1])
                    except Exception:  # noqa: BLE001 - a batch it cannot read is not counted, the run goes on
                        pass
        finally:
            for sub in subs:
                sub.close(0)


def moved_turns(routed: dict) -> int:
    """Returning turns answered by another replica than the conversation's previous turn (`routed`:
    (user, turn) -> replica)."""
    return sum(1 for (u, t), replica in routed.items()
               if t > 0 and (u, t - 1) in routed and replica and replica != routed[(u, t - 1)])


def floor_tokens(trace_path: Path) -> int:
    """The prompt tokens one cache that never evicts computes on the recorded requests (each 32-token block of the
    prompts once, every request in its order): what a policy must compute, give or take the shared prefix each
    replica computes once and the blocks vLLM filled with a reply, which it caches too (a sticky policy can come
    in under this)."""
    from kvtier.bench.servers import BLOCK_TOKENS
    from kvtier.sim.replay import max_hit_tokens
    from kvtier.sim.trace import read_trace

    requests = read_trace(trace_path, BLOCK_TOKENS)
    return sum(r.input_length for r in requests) - max_hit_tokens(requests, BLOCK_TOKENS)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


@contextmanager
def front_door(policy: str, replicas: Replicas, root: Path, model_dir: Path, *, shared_pool: bool):
    """The router for `policy` over `replicas`, as a user runs it; yields its base URL."""
    from kvtier.bench.servers import BLOCK_TOKENS, _stop_group
    from kvtier.ports import free_port

    port = free_port()
    log = root / f"router-{policy}.log"
    with ExitStack() as stack:
        if policy == "sglang":
            argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *replicas.urls,
                    "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
        else:
            scale = dynamo_scale(policy)
            argv = [sys.executable, "-m", "kvtier", "route", "--policy", policy if scale is None else "dynamo",
                    "--port", str(port)]
            for url in replicas.urls:
                argv += ["--replica", url]
            if scale is not None:
                from kvtier.bench.dynamo import DynamoSelectService

                selector = stack.enter_context(DynamoSelectService(
                    root / "select.log", env={"DYN_ROUTER_PREFILL_LOAD_SCALE": repr(scale)}))
                argv += ["--selector", selector.url, "--tokenizer", str(model_dir), "--block-size", str(BLOCK_TOKENS)]
                for events, replay in zip(replicas.events, replicas.replays):
                    argv += ["--kv-events", events, "--kv-events-replay", replay]
                if shared_pool:
                    argv.append("--shared-pool")
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        stack.callback(_stop_group, proc, timeout_s=10)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/v1/models", proc, log)
        yield url


# -- the run ---------------------------------------------------------------------------------------------

def _replica_counts(before: dict, after: dict) -> dict:
    """One replica's share of the run, from its /metrics: requests, prompt tokens, computed, cached by tier, and
    kvtier's blocks that failed to load (recomputed) or were not saved (a later miss)."""
    from kvtier.bench.vllm import _cached_tokens, _delta

    return {"requests": int(_delta(before, after, "vllm:request_success_total")),
            "prompt_tokens": int(_delta(before, after, "vllm:prompt_tokens_total")),
            "computed_tokens": int(_delta(before, after, "vllm:request_prefill_kv_computed_tokens_sum")),
            "prefill_s": _delta(before, after, "vllm:request_prefill_time_seconds_sum"),
            "preemptions": int(_delta(before, after, "vllm:num_preemptions_total")),
            "failed_blocks": int(_delta(before, after, "kvtier:failed_blocks_total")),
            "dropped_blocks": int(_delta(before, after, "kvtier:dropped_blocks_total")),
            "cached_tokens_by_tier": _cached_tokens(before, after)}


def _selector_matched(url: str) -> dict[str, dict[str, int]]:
    """What Dynamo's selector matched for the replicas it chose, per tier (`gpu`, `cpu` = device + host,
    `disk` = every tier, the pool's shared blocks too), summed over the run: kvtier route's /metrics."""
    import re

    import httpx

    out: dict[str, dict[str, int]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'kvtier_route_selector_matched_tokens_total\{(.*)\}\s+(\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out.setdefault(labels["replica"], {})[labels["tier"]] = int(float(m.group(2)))
    return out


def _row(result: RouteResult, reference: RouteResult | None, replicas: list[dict] | None) -> dict:
    ttfts = sorted(t.ttft_s for t in result.turns.values())
    itls = [gap for t in result.turns.values() for gap in t.itl_s]
    same = None if reference is None else result.texts == reference.texts  # a router may drop return_token_ids
    row = {"system": result.name, "requests": len(result.turns), "failed": result.num_failed,
           "cut_mid_stream": result.num_cut, "ttft_p50_s": _pct(ttfts, 50),
           "ttft_p90_s": _pct(ttfts, 90), "itl_mean_s": sum(itls) / len(itls) if itls else 0.0,
           "wall_s": result.wall_s, "same_replies_as_reference": same,
           "first_error": result.first_error, "moved_turns": moved_turns(result.routed),
           "routed": [[u, t, result.routed.get((u, t), ""), *result.usage.get((u, t), (0, 0))]
                      for (u, t) in sorted(result.texts)]}  # user, turn, replica, prompt tokens, cached tokens
    if replicas:
        cached: dict[str, int] = {}
        for r in replicas:
            for tier, n in r["cached_tokens_by_tier"].items():
                cached[tier] = cached.get(tier, 0) + n
        prompt = sum(r["prompt_tokens"] for r in replicas)
        row |= {"prompt_tokens": prompt, "computed_tokens": sum(r["computed_tokens"] for r in replicas),
                "cached_tokens_by_tier": cached, "requests_per_replica": [r["requests"] for r in replicas],
                "prefix_hit_rate": sum(cached.values()) / prompt if prompt else 0.0,
                "preemptions": sum(r.get("preemptions", 0) for r in replicas), "replicas": replicas}
        removed: dict[str, int] = {}
        for r in replicas:
            for medium, n in r.get("events", {}).get("removed", {}).items():
                removed[medium] = removed.get(medium, 0) + n
        row["blocks_removed"] = removed  # announced BlockRemoved, per medium, both replicas
    return row


def _record_trace(prompts: dict, result: RouteResult, path: Path, max_tokens: int) -> None:
    """`result`'s requests as a Mooncake-format trace of 32-token blocks, in the order and at the times that
    run submitted them; the prompts (`(user, turn)` -> token ids) are the reference's: the same, as long
    as every reply was."""
    from kvtier.bench.servers import BLOCK_TOKENS
    from kvtier.sim.trace import TraceRecorder, trace_hash_ids

    with TraceRecorder(path, block_tokens=BLOCK_TOKENS) as recorder:
        for key, turn in sorted(result.turns.items(), key=lambda kv: kv[1].start_s):
            ids = prompts[key]
            recorder.record(round(turn.start_s * 1000, 3), len(ids), max_tokens,
                            trace_hash_ids(ids, block_tokens=BLOCK_TOKENS))


def simulate(trace_path: Path, policy: str, setup: str, *, device_blocks: int, prefill_tokens_per_s: float,
             decode_s_per_token: float = 0.0, num_replicas: int = 2, tier_blocks: int = 0,
             root_first_tiers: bool = False) -> dict:
    """`kvtier simulate`'s prediction for one system: its router model on the recorded trace, each replica's
    device budget as HBM, the `shm:` tier as DRAM (`tier_blocks` blocks, or never full with 0; its LRU takes a
    request's blocks tail first, as kvtier's tiers refresh them), the pool (`pool` setup) as the shared tier, a
    replica's prefill and decode at the speeds its run measured (Dynamo's load terms weigh a replica's queue and
    its running requests). `root_first_tiers`: the tiers take a request's blocks root first, as kvtier's
    connector admitted them before its tiers went tail first (the runs recorded in `tests/sim/data`)."""
    from kvtier.bench.servers import BLOCK_TOKENS
    from kvtier.sim.cluster import ClusterConfig
    from kvtier.sim.replay import replay
    from kvtier.sim.trace import read_trace

    large = 1 << 40  # the workload never fills the tiers
    config = ClusterConfig(num_nodes=num_replicas, gpus_per_node=1, hbm_tokens=device_blocks * BLOCK_TOKENS,
                           dram_tokens=tier_blocks * BLOCK_TOKENS if tier_blocks else large,
                           pool_tokens=large if setup == "pool" else 0,
                           block_tokens=BLOCK_TOKENS, flops_per_token=1.0, gpu_flops=prefill_tokens_per_s, mfu=1.0,
                           kv_bytes_per_token=KV_BYTES_PER_TOKEN, decode_s_per_token=decode_s_per_token,
                           root_first_tiers=root_first_tiers)
    result = replay(read_trace(trace_path, BLOCK_TOKENS), config, _sim_router(policy))
    return {"router": _sim_router(policy), "prefix_hit_rate": result.hit_rate,
            "requests_per_replica": result.requests_by_node}


def run(w: Workload, *, policies=POLICIES, setups=SETUPS, device_blocks: int = 20, kill: bool = False,
        log_dir: str | None = None, tier_blocks: int = 0, shared_prefix_chars: int = 0) -> dict:
    """Every system's row (and the reference's), the trace path, the floor, and each system's simulated hit rate;
    `tier_blocks`: each replica's `shm:` tier in blocks (0: never full); `shared_prefix_chars`: the preamble
    every user's system prompt carries (`shared_prefix`)."""
    from kvtier import models
    from kvtier.bench.pools import RedisServer
    from kvtier.bench.servers import BLOCK_TOKENS, VllmServer
    from kvtier.data import SHAKESPEARE, shared_data_file

    import importlib.util

    if "sglang" in policies and importlib.util.find_spec("sglang_router") is None:
        print("sglang skipped: PyPI sglang-router is not installed (`pip install sglang-router`, in the `peers` "
              "extra)", file=sys.stderr)
        policies = tuple(p for p in policies if p != "sglang")
    model_dir = models.cache_dir() / "smollm2-135m-instruct"
    models.load("smollm2", device="cpu")  # converted on first use
    text = shared_data_file(SHAKESPEARE).read_text()
    convs, preamble = conversations(text, w), shared_prefix(text, shared_prefix_chars)
    root = Path(log_dir or tempfile.mkdtemp(prefix="kvtier-bench-route-"))
    root.mkdir(parents=True, exist_ok=True)
    prompts: dict = {}
    print(f"kvtier bench route: {len(convs)} users x {w.num_turns} turns; logs in {root}", file=sys.stderr)
    with VllmServer(model_dir, root / "reference.log", max_model_len=(device_blocks - 1) * BLOCK_TOKENS) as ref:
        reference = _run_chat(ref.url, convs, w, REFERENCE, prompts=prompts, preamble=preamble)
    trace_path = root / "trace.jsonl"
    _record_trace(prompts, reference, trace_path, w.max_tokens)
    floor = floor_tokens(trace_path)
    print(f"  floor: {floor:,} of {sum(len(p) for p in prompts.values()):,} prompt tokens", file=sys.stderr)
    rows = [_row(reference, None, None)]
    for setup in setups:
        for policy in policies:
            name = f"{policy}/{setup}"
            tmp = root / name.replace("/", "-")
            tmp.mkdir(exist_ok=True)
            with ExitStack() as stack:
                pool_spec = None
                if setup == "pool":
                    pool = RedisServer(tmp, maxmemory=POOL_MAXMEMORY)
                    stack.callback(pool.kill)
                    pool.start()
                    pool_spec = pool.spec
                replicas = stack.enter_context(Replicas(model_dir, tmp, num_blocks=device_blocks, pool_spec=pool_spec,
                                                        tier_blocks=tier_blocks))
                url = stack.enter_context(front_door(policy, replicas, tmp, model_dir, shared_pool=setup == "pool"))
                before = [s.metrics() for s in replicas.servers]
                with EventCounter(replicas.events) as events:
                    result = _run_chat(url, convs, w, name, preamble=preamble)
                    counts = [_replica_counts(b, s.metrics()) for b, s in zip(before, replicas.servers)]
                    time.sleep(1.0)  # the last step's events
                for count, announced in zip(counts, events.counts):
                    count["events"] = announced
                row = _row(result, reference, counts)
                speed = sum(c["computed_tokens"] for c in counts) / max(1e-9, sum(c["prefill_s"] for c in counts))
                own_trace = tmp / "trace.jsonl"  # this run's order: round-robin's luck, Dynamo's queues
                _record_trace(prompts, result, own_trace, w.max_tokens)
                row["simulated"] = simulate(own_trace, policy, setup, device_blocks=device_blocks,
                                            prefill_tokens_per_s=speed, decode_s_per_token=row["itl_mean_s"],
                                            tier_blocks=tier_blocks)
                row["trace"] = str(own_trace)
                if dynamo_scale(policy) is not None:
                    row["selector_matched_tokens"] = _selector_matched(url)
                rows.append(row)
                if kill:
                    killed = _run_chat(url, convs, w, f"{name} (replica 2 killed)", kill=lambda: replicas.kill(1),
                                       preamble=preamble)
                    rows.append(_row(killed, reference, None))
    return {"rows": rows, "trace": str(trace_path), "device_blocks": device_blocks, "tier_blocks": tier_blocks,
            "floor_computed_tokens": floor,
            "workload": {"users": w.num_users, "turns": w.num_turns, "context_chars": w.context_chars,
                         "turn_chars": w.turn_chars, "max_tokens": w.max_tokens,
                         "shared_prefix_chars": shared_prefix_chars}}


# -- the report ------------------------------------------------------------------------------------------

def render(result: dict) -> str:
    lines = ["| system | requests | failed | cut mid-stream | TTFT p50 | TTFT p90 | prompt tokens | computed | "
             "loaded by tier | requests per replica | prefix hit rate | simulated | moved turns | blocks removed | "
             "same replies |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        same = {None: "(reference)", True: "yes", False: "NO"}[r["same_replies_as_reference"]]
        cells = [r["system"], r["requests"], r["failed"], r["cut_mid_stream"], f"{r['ttft_p50_s']:.2f} s",
                 f"{r['ttft_p90_s']:.2f} s"]
        if "prefix_hit_rate" in r:
            sim = r.get("simulated")
            cells += [f"{r['prompt_tokens']:,}", f"{r['computed_tokens']:,}",
                      ", ".join(f"{k}: {v:,}" for k, v in r["cached_tokens_by_tier"].items()) or "–",
                      " / ".join(str(n) for n in r["requests_per_replica"]), f"{r['prefix_hit_rate']:.0%}",
                      f"{sim['prefix_hit_rate']:.0%} ({sim['router']})" if sim else "–", r.get("moved_turns", 0),
                      ", ".join(f"{k}: {v:,}" for k, v in r.get("blocks_removed", {}).items()) or "0"]
        else:
            cells += ["–"] * 8
        lines.append("| " + " | ".join(str(c) for c in cells + [same]) + " |")
    if "floor_computed_tokens" in result:
        lines.append(f"\nFloor (one cache that never evicts, the prompts' blocks each computed once): "
                     f"{result['floor_computed_tokens']:,} prompt tokens.")
    return "\n".join(lines)


def plot(result: dict, path: str, title: str) -> None:
    """TTFT p50 / p90 per system, and prompt tokens computed vs loaded (device, kvtier's tiers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in result["rows"] if "prefix_hit_rate" in r]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(x - 0.2, [r["ttft_p50_s"] for r in rows], 0.4, label="TTFT p50")
    ax1.bar(x + 0.2, [r["ttft_p90_s"] for r in rows], 0.4, label="TTFT p90")
    ax1.set_ylabel("seconds")
    ax1.legend()
    bottom = np.zeros(len(rows))
    tiers = sorted({t for r in rows for t in r["cached_tokens_by_tier"]})
    for label, values in [("computed", [r["computed_tokens"] for r in rows])] + \
            [(f"loaded: {t}", [r["cached_tokens_by_tier"].get(t, 0) for r in rows]) for t in tiers]:
        ax2.bar(x, values, bottom=bottom, label=label)
        bottom += np.array(values, dtype=float)
    ax2.set_ylabel("prompt tokens")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x, [r["system"] for r in rows], rotation=20, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_command(bench) -> None:
    """Register `kvtier bench route` on the `bench` typer group."""
    import typer

    @bench.command("route")
    def route(users: int = typer.Option(4, min=1), turns: int = typer.Option(3, min=1),
              context_chars: int = typer.Option(900, min=1), turn_chars: int = typer.Option(160, min=1),
              max_tokens: int = typer.Option(16, min=1),
              device_blocks: int = typer.Option(20, min=4, help="each replica's device KV blocks (of 32 tokens)"),
              tier_blocks: int = typer.Option(0, min=0, help="each replica's shm: tier in blocks of 32 tokens, "
                                              "so kvtier evicts (0: 1 GiB, never full)"),
              shared_prefix_chars: int = typer.Option(0, min=0, help="a preamble of this many characters every "
                                                      "user's system prompt carries before its passage"),
              policies: str = typer.Option(",".join(POLICIES), help=", ".join(POLICIES) + ", dynamo:S (Dynamo's "
                                           "prefill_load_scale S, DYN_ROUTER_PREFILL_LOAD_SCALE of its service)"),
              setups: str = typer.Option(",".join(SETUPS), help="local (shm: per replica), pool (+ one Redis)"),
              kill: bool = typer.Option(False, "--kill", help="then again, replica 2 killed mid-run"),
              json_path: str = typer.Option(None, "--json", help="write the rows (and the trace's path) here"),
              plot_path: str = typer.Option(None, "--plot", help="write a PNG of TTFT and computed vs loaded"),
              log_dir: str = typer.Option(None, help="where logs and the trace go (default: a temp dir)")) -> None:
        """2 replicas of vLLM + kvtier behind round-robin, SGLang's cache-aware router and Dynamo on kvtier's events."""
        from kvtier.errors import UserError

        names = tuple(p.strip() for p in policies.split(","))
        kinds = tuple(s.strip() for s in setups.split(","))
        if {n for n in names if dynamo_scale(n) is None} - set(POLICIES) or set(kinds) - set(SETUPS):
            raise UserError(f"policies among {', '.join(POLICIES)} (or dynamo:S, Dynamo with prefill_load_scale "
                            f"S); setups among {', '.join(SETUPS)}")
        result = run(Workload(users, turns, context_chars, turn_chars, max_tokens), policies=names, setups=kinds,
                     device_blocks=device_blocks, kill=kill, log_dir=log_dir, tier_blocks=tier_blocks,
                     shared_prefix_chars=shared_prefix_chars)
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        if plot_path:
            tier = f", shm: {tier_blocks} blocks" if tier_blocks else ""
            shared = f", {shared_prefix_chars}-char shared prefix" if shared_prefix_chars else ""
            plot(result, plot_path, f"kvtier bench route: {users} users x {turns} turns{shared}, 2 replicas x "
                                    f"{device_blocks} device blocks{tier} (SmolLM2 fp32, vLLM CPU, 1 core each)")
        print(render(result))
        for r in result["rows"]:
            if r["first_error"]:
                print(f"{r['system']}: first failure: {r['first_error']}")

