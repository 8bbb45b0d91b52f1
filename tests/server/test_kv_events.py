"""`kvtier serve --kv-events-config`: vLLM's KV cache events from kvtier's own publisher (`kvtier/events/`,
`server/kv_events.py`), read by a ZMQ subscriber as a router would.

The wire format is checked against vLLM 0.32's own encoder and decoder (`.venv-vllm`, a subprocess). The
served app is the tiny model on 16 device blocks over a small DRAM tier and an SSD directory, started by
`build_app` as `kvtier serve` does; the tests run in order on the state the previous ones left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvtier.blocks import block_keys
from kvtier.config import EngineConfig
from kvtier.errors import ConfigError
from kvtier.events import wire
from kvtier.events.publisher import KvEventsConfig
from kvtier.server.cli import build_app
from kvtier.server.config import ServeConfig
from kvtier.tiers.spec import parse_specs

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 8
DEVICE_BLOCKS, DRAM_BLOCKS, SSD_BLOCKS = 16, 10, 200
BLOCK_BYTES = 2 * 2 * 2 * 16 * BLOCK * 4  # the tiny Llama: K and V, 2 layers, 2 KV heads, head dim 16, fp32

# vLLM's own encoding of a batch (what its ZmqEventPublisher sends), and its decoding of ours
_VLLM_CHECK = """import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
ours, salted = (bytes.fromhex(line) for line in sys.stdin.read().split())
batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(ours)
salted_batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(salted)  # a field vLLM does not know: skipped
theirs = KVEventBatch(ts=1765000000.25, data_parallel_rank=0, events=[
    BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(16)), block_size=8,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[("tenant-a",), None]),
    BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=[3] * 8, block_size=8, lora_id=None,
                medium="STORAGE", lora_name=None),
    BlockRemoved(block_hashes=[7, 9], medium="CPU"), AllBlocksCleared()])
print(json.dumps({"same": msgspec.msgpack.Encoder().encode(theirs) == ours, "decoded": repr(batch),
                  "salted": repr(salted_batch)}))
"""


def test_a_batch_is_byte_for_byte_what_vllm_s_publisher_sends():
    if not VLLM_PYTHON.exists():
        pytest.skip(".venv-vllm is missing: `make vllm` creates it (`make test` does)")
    ours = wire.encode_batch(1765000000.25, [
        wire.block_stored([2**64 - 1, 7], None, list(range(16)), 8, "GPU", extra_keys=[("tenant-a",), None]),
        wire.block_stored([9], 7, [3] * 8, 8, "STORAGE"),
        wire.block_removed([7, 9], "CPU"), wire.all_blocks_cleared()])
    # kvtier serve's salted block: vLLM's fields plus `cache_salt` (what NVIDIA Dynamo's index reads)
    salted_event = wire.block_stored([5], None, [1] * 8, 8, "GPU", extra_keys=[("tenant-a",)], cache_salt="tenant-a")
    assert salted_event["cache_salt"] == "tenant-a"
    assert "cache_salt" not in wire.block_stored([5], None, [1] * 8, 8, "GPU")
    salted = wire.encode_batch(1765000000.25, [salted_event])
    out = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_CHECK], input=f"{ours.hex()}\n{salted.hex()}",
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"], result["decoded"]
    assert "block_hashes=[5]" in result["salted"] and "extra_keys=[('tenant-a',)]" in result["salted"]
    assert "extra_keys=[('tenant-a',), None]" in result["decoded"] and "medium='STORAGE'" in result["decoded"]


def test_the_config_is_vllm_s_json():
    config = KvEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x", "topic": "kv"}')
    assert (config.enabled, config.publisher, config.endpoint, config.topic) == (True, "zmq", "ipc:///tmp/x", "kv")
    assert (config.replay_endpoint, config.buffer_steps, config.hwm, config.max_queue_size) == \
        (None, 10_000, 100_000, 100_000)
    assert not KvEventsConfig.parse('{"publisher": "zmq"}').enabled  # vLLM's: events must be enabled too
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    with pytest.raises(ConfigError, match="unknown field.*endpiont"):
        KvEventsConfig.parse('{"enable_kv_cache_events": true, "endpiont": "tcp://*:5557"}')
    with pytest.raises(ConfigError, match="not JSON"):
        KvEventsConfig.parse("{enable_kv_cache_events: true}")
    with pytest.raises(ConfigError, match="buffer_steps"):
        KvEventsConfig.parse('{"enable_kv_cache_events": true, "buffer_steps": 0}')


def test_an_endpoint_in_use_is_a_one_line_config_error():
    from kvtier.events.publisher import KvEventPublisher

    # vLLM's rule: a wildcard endpoint is bound (port 0: the OS picks one), a host's is connected to
    first = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"), list)
    try:
        port = int(first.endpoint.rsplit(":", 1)[1])
        assert port > 0
        with pytest.raises(ConfigError, match=f"cannot open tcp://\\*:{port}: Address already in use"):
            KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"), list)
    finally:
        first.close()


class Subscriber:
    """A router's view: every batch on a SUB socket (seq, events), and per medium the block hashes held."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list[dict]]] = []
        self.held: dict[str, set[int]] = {}
        self.stored: list[dict] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self.sock.poll(50):
                continue
            _, seq, payload = self.sock.recv_multipart()
            _, events, rank = wire.decode_batch(payload)
            assert rank == 0
            with self._lock:
                self.batches.append((int.from_bytes(seq, "big"), events))
                for event in events:
                    held = self.held.setdefault(event.get("medium"), set())
                    if event["type"] == "BlockStored":
                        held.update(event["block_hashes"])
                        self.stored.append(event)
                    elif event["type"] == "BlockRemoved":
                        held.difference_update(event["block_hashes"])

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {medium: len(hashes) for medium, hashes in self.held.items()}

    def holds(self, medium: str) -> set[int]:
        with self._lock:
            return set(self.held.get(medium, ()))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close(linger=0)


def wait_for(fn, done, what, timeout_s: float = 60.0):
    """`fn()` once `done` with it; `what` (or `what()`) names it in the error after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}: last {value!r}")
        time.sleep(0.05)


def serve_config(ssd: Path, events: dict) -> ServeConfig:
    """The tiny model on 16 device blocks, DRAM for ten, the SSD directory `ssd`; `events`: vLLM's JSON."""
    return ServeConfig(model="tiny", tiers=parse_specs([f"dram:{DRAM_BLOCKS * (BLOCK_BYTES + 64)}",
                                                       f"ssd:{ssd}:{SSD_BLOCKS * (BLOCK_BYTES + 64)}"]),
                       kv_events_config=json.dumps({"enable_kv_cache_events": True, **events}),
                       engine=EngineConfig(device_kv_budget_bytes=DEVICE_BLOCKS * BLOCK_BYTES, block_tokens=BLOCK,
                                           max_prefill_tokens=64, max_model_tokens=512))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-events")
    endpoint, replay = f"ipc://{root}/events.sock", f"ipc://{root}/replay.sock"
    app = build_app(serve_config(root / "ssd", {"endpoint": endpoint, "replay_endpoint": replay}))
    sub = Subscriber(endpoint)
    time.sleep(0.3)  # the subscription settles before the first event
    try:
        with running(app) as url:
            yield {"url": url, "app": app, "sub": sub, "replay": replay, "ssd": root / "ssd"}
    finally:
        sub.close()


def _engine(served):
    return served["app"].state.kvtier.engine.engine


def _complete(served, prompt: str, **extra) -> dict:
    import httpx

    reply = httpx.post(served["url"] + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _own_counts(served) -> dict[str, int]:
    """The engine's own: keyed device blocks, blocks in the DRAM tier, block files on the SSD."""
    engine = _engine(served)
    tiers = {tier.name: tier.num_blocks() for tier in engine.manager.tiers}
    return {"GPU": len(engine.block_manager.key_to_block), "CPU": tiers["dram"],
            "STORAGE": sum(1 for _ in served["ssd"].rglob("*.kvb"))}


def _tier_report(engine) -> str:
    manager = engine.manager
    return f"stats {manager.stats()}, writes dropped {manager.num_dropped_writes}, pending {manager.num_pending_writes}"


def _hashes(served, prompt: str, salt: str = "") -> list[int]:
    """vLLM's block hashes of the full blocks of `prompt` (byte tokens), from kvtier's keys."""
    space = _engine(served).scheduler.space.with_namespace(salt)
    return [wire.block_hash(key) for key in block_keys(space, list(prompt.encode()))]


PROMPTS = [f"prompt {i}: " + "".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(60)) for i in range(6)]


def test_a_request_s_blocks_are_announced_on_the_device_and_in_each_tier(served):
    sub = served["sub"]
    _complete(served, PROMPTS[0])
    counts = wait_for(lambda: (sub.counts(), _own_counts(served)), lambda c: c[0] == c[1] and c[0]["STORAGE"] > 0,
                      "the announced counts to be the engine's")[0]
    hashes = _hashes(served, PROMPTS[0])
    assert len(hashes) == len(PROMPTS[0]) // BLOCK == 8
    for medium in ("GPU", "CPU", "STORAGE"):
        assert set(hashes) <= sub.holds(medium), medium
    assert counts["GPU"] >= len(hashes)
    # self-describing: each block's tokens, its size and its parent (the previous block of the prompt)
    first = {e["block_hashes"][0]: e for e in sub.stored if e["medium"] == "STORAGE"}
    assert first[hashes[0]]["parent_block_hash"] is None and first[hashes[0]]["block_size"] == BLOCK
    assert first[hashes[3]]["parent_block_hash"] == hashes[2]
    assert first[hashes[3]]["token_ids"] == list(PROMPTS[0].encode()[3 * BLOCK:4 * BLOCK])
    assert "extra_keys" not in first[hashes[0]]  # no cache_salt


def test_device_eviction_is_removed_on_the_device_only(served):
    sub, hashes = served["sub"], _hashes(served, PROMPTS[0])
    for prompt in PROMPTS[1:3]:  # 2 x 9 blocks more on 16 device blocks: the first prompt's are reused
        _complete(served, prompt)
    wait_for(lambda: (sub.counts(), _own_counts(served)), lambda c: c[0] == c[1], "the counts after evictions")
    assert not set(hashes) & sub.holds("GPU")
    assert not set(hashes) & sub.holds("CPU")          # DRAM holds ten blocks: the last prompt's
    assert set(hashes) <= sub.holds("STORAGE")         # still on the SSD
    removed = {h for _, events in sub.batches for e in events
               if e["type"] == "BlockRemoved" and e["medium"] == "GPU" for h in e["block_hashes"]}
    assert set(hashes) <= removed


def test_a_corrupt_ssd_block_deleted_is_removed_then_announced_again(served):
    sub, hashes = served["sub"], _hashes(served, PROMPTS[0])
    engine = _engine(served)
    key = block_keys(engine.scheduler.space, list(PROMPTS[0].encode()))[2]
    victim = served["ssd"] / key.hex()[:2] / f"{key.hex()}.kvb"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF  # a payload byte: its checksum no longer holds
    victim.write_bytes(bytes(data))
    num_stored = sum(1 for e in sub.stored if e["medium"] == "STORAGE" and hashes[2] in e["block_hashes"])
    _complete(served, PROMPTS[0])  # loads blocks 0-1 from the SSD, finds block 2 corrupt: deleted, recomputed
    wait_for(lambda: sum(1 for e in sub.stored if e["medium"] == "STORAGE" and hashes[2] in e["block_hashes"]),
             lambda n: n == num_stored + 1, lambda: f"the recomputed block stored again ({_tier_report(engine)})")
    removed = [h for _, events in sub.batches for e in events
               if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE" for h in e["block_hashes"]]
    assert removed.count(hashes[2]) == 1 and hashes[0] not in removed
    assert set(hashes) <= sub.holds("GPU") and set(hashes) <= sub.holds("STORAGE")
    wait_for(lambda: (sub.counts(), _own_counts(served)), lambda c: c[0] == c[1], "the counts after the reload")


def test_two_tenants_blocks_have_their_own_hashes_and_the_salt_in_the_first_block(served):
    sub = served["sub"]
    _complete(served, PROMPTS[3], cache_salt="tenant-a")
    _complete(served, PROMPTS[3], cache_salt="tenant-b")
    a, b = _hashes(served, PROMPTS[3], "tenant-a"), _hashes(served, PROMPTS[3], "tenant-b")
    wait_for(lambda: sub.holds("STORAGE"), lambda held: set(a + b) <= held, "both tenants on the SSD")
    assert not set(a) & set(b) and not set(a) & set(_hashes(served, PROMPTS[3]))
    first = {e["block_hashes"][0]: e for e in sub.stored}
    assert first[a[0]]["extra_keys"] == [["tenant-a"]] and first[b[0]]["extra_keys"] == [["tenant-b"]]
    assert "extra_keys" not in first[a[1]]  # vLLM's: the salt goes with a prompt's first block only


def test_the_replay_socket_returns_past_batches(served):
    sub = served["sub"]
    with sub._lock:
        seen = list(sub.batches)
    assert [seq for seq, _ in seen] == list(range(len(seen)))  # in order, none lost
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(served["replay"])
    try:
        sock.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), wire.decode_batch(payload)[1]))
    finally:
        sock.close(linger=0)
    assert replayed[:len(seen) - 2] == seen[2:]


def test_metrics_count_the_batches_published_and_none_dropped(served):
    import httpx

    text = httpx.get(served["url"] + "/metrics").text
    batches = float(next(line.split()[1] for line in text.splitlines()
                         if line.startswith("kvtier_kv_events_batches_total ")))
    with served["sub"]._lock:
        assert batches >= len(served["sub"].batches) > 0
    assert "kvtier_kv_events_dropped_total 0.0" in text


def test_blocks_loaded_from_an_earlier_run_s_ssd_are_announced_there(served, tmp_path):
    """A second server on the same SSD directory (a restart): it never wrote the files it loads."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    app = build_app(serve_config(served["ssd"], {"endpoint": endpoint}))
    sub = Subscriber(endpoint)
    time.sleep(0.3)
    try:
        with running(app) as url:
            again = {"url": url, "app": app, "ssd": served["ssd"]}
            _complete(again, PROMPTS[1])  # on the SSD since the second test: its 8 usable blocks are loaded
            hashes = _hashes(again, PROMPTS[1])
            wait_for(lambda: sub.holds("STORAGE"), lambda held: set(hashes) <= held, "the loaded blocks on the SSD")
            assert set(hashes) <= sub.holds("GPU")
            loaded = _engine(again).scheduler.prefix_hit_tokens_by_tier
            assert loaded.get("ssd") == len(hashes) * BLOCK  # loaded, not recomputed
    finally:
        sub.close()
