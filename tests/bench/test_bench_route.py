"""`kvtier bench route`'s plumbing without vLLM: the chat client over a stub OpenAI replica (conversations
come back with their replies, a stream cut mid-way is retried once, the kill fires once a quarter is
answered), the rows against the reference, the trace it records for `kvtier simulate` and the report."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvtier.bench import route
from kvtier.bench.harness import Workload
from kvtier.sim.trace import read_trace
from kvtier.testing.app_thread import AppThread


class ChatStub:
    """Streams `max_tokens` tokens, each the prompt's length plus its index; `cut`: the first N streams die
    after their first chunk."""

    def __init__(self, cut: int = 0) -> None:
        self.bodies: list[dict] = []
        self.cut = cut

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            prompt = [len(m["content"]) for m in body["messages"]]
            cut, self.cut = self.cut > 0, max(0, self.cut - 1)

            async def stream():
                yield f"data: {json.dumps({'prompt_token_ids': prompt, 'choices': []})}\n\n".encode()
                for i in range(body["max_tokens"]):
                    if cut and i == 1:
                        raise RuntimeError("replica killed")
                    tok = len(prompt) + i
                    choice = {"delta": {"content": f"t{tok} "}, "token_ids": [tok]}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
                usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": len(prompt) - 2}}  # all but the last turn
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return app


W = Workload(num_users=2, num_turns=2, context_chars=40, turn_chars=10, max_tokens=3)
CONVS = [("passage one", ["hello", "again"]), ("passage two", ["hi", "more"])]


def test_each_user_s_turns_come_back_with_the_replies_and_are_recorded_as_a_trace(tmp_path):
    stub, prompts, killed = ChatStub(), {}, []
    with AppThread(stub.app()) as server:
        result = route._run_chat(server.url, CONVS, W, "x", prompts=prompts, kill=lambda: killed.append(1))
    assert len(result.turns) == 4 and result.num_failed == 0 and killed == [1]
    second = next(b for b in stub.bodies if len(b["messages"]) == 4 and "one" in b["messages"][0]["content"])
    assert second["messages"][2] == {"role": "assistant", "content": "t2 t3 t4 "}  # turn 1's reply, then turn 2
    assert result.turns[(0, 1)].token_ids == [4, 5, 6] and result.num_prompt_tokens == 2 * (2 + 4)
    assert prompts[(0, 1)] == [len(f"{route.SYSTEM_PROMPT}\n\npassage one"), 5, 9, 5]  # system, user, reply, user
    route._record_trace(prompts, result, tmp_path / "trace.jsonl", W.max_tokens)
    requests = read_trace(tmp_path / "trace.jsonl", 32)
    assert [r.input_length for r in requests][-1] == 4 and sorted(r.input_length for r in requests) == [2, 2, 4, 4]
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    turn1 = [r for r in requests if r.input_length == 2]
    assert turn1[0].hash_ids != turn1[1].hash_ids  # two users' prompts: different blocks


def test_a_stream_cut_mid_way_is_retried_once_and_counted(tmp_path):
    stub = ChatStub(cut=1)
    with AppThread(stub.app()) as server:
        result = route._run_chat(server.url, CONVS[:1], W, "x")
    assert result.num_cut == 1 and result.num_failed == 0 and len(result.turns) == 2
    assert len(stub.bodies) == 3


def test_rows_compare_every_reply_with_the_reference_and_the_report_renders(tmp_path):
    stub = ChatStub()
    with AppThread(stub.app()) as server:
        reference = route._run_chat(server.url, CONVS, W, route.REFERENCE)
        same = route._run_chat(server.url, CONVS, W, "round-robin/local")
    other = route._run_chat("http://127.0.0.1:9", CONVS[:1], W, "dead")  # nothing listens: every request fails
    replica = {"requests": 2, "prompt_tokens": 100, "computed_tokens": 40, "preemptions": 0,
               "cached_tokens_by_tier": {"device": 32, "shm": 28}}
    rows = [route._row(reference, None, None), route._row(same, reference, [replica, replica]),
            route._row(other, reference, None)]
    assert [r["same_replies_as_reference"] for r in rows] == [None, True, False]
    assert rows[1]["prefix_hit_rate"] == 0.6 and rows[1]["requests_per_replica"] == [2, 2]
    assert rows[1]["cached_tokens_by_tier"] == {"device": 64, "shm": 56}
    assert rows[2]["failed"] == 1 and "ConnectError" in rows[2]["first_error"]
    # per turn: user, turn, the replica that answered (the stub sends no header), prompt and cached tokens
    assert rows[1]["routed"] == [[0, 0, "", 2, 0], [0, 1, "", 4, 2], [1, 0, "", 2, 0], [1, 1, "", 4, 2]]
    table = route.render({"rows": rows})
    assert "| round-robin/local | 4 | 0 | 0 |" in table and "60%" in table and "| yes |" in table
    route.plot({"rows": rows}, str(tmp_path / "route.png"), "t")
    assert (tmp_path / "route.png").stat().st_size > 0


def test_tier_blocks_bound_each_replica_s_shm_tier_to_that_many_of_its_blocks(tmp_path):
    from kvtier.blocks import KVLayout
    from kvtier.codecs import get_codec
    from kvtier.tiers.spec import parse_specs

    smollm2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=32)
    block_file = get_codec("raw").max_encoded_bytes(smollm2)  # what the tier's index counts per block
    assert smollm2.block_bytes == 32 * route.KV_BYTES_PER_TOKEN
    for n in (1, 40, 120):
        (spec,) = parse_specs([route.shm_spec(tmp_path, n)])
        assert spec.kind == "shm" and spec.capacity_bytes // block_file == n
    (never_full,) = parse_specs([route.shm_spec(tmp_path)])
    assert never_full.capacity_bytes == 1 << 30
    replicas = route.Replicas(tmp_path, tmp_path, num_blocks=26, pool_spec="redis://127.0.0.1:1/0", tier_blocks=40)
    configs = [json.loads(s.argv[s.argv.index("--kv-transfer-config") + 1]) for s in replicas.servers]
    for config, shm in zip(configs, replicas.shm_dirs):
        assert config["kv_connector_extra_config"]["tiers"] == [route.shm_spec(shm, 40), "redis://127.0.0.1:1/0"]
    replicas.__exit__()


def test_the_shared_prefix_opens_every_user_s_system_prompt_before_the_passage():
    stub = ChatStub()
    preamble = route.shared_prefix("x" * 50 + "the end.", 8)
    assert preamble == "the end." and route.shared_prefix("abc", 0) == ""
    with AppThread(stub.app()) as server:
        route._run_chat(server.url, CONVS, W, "x", preamble=preamble)
    systems = {b["messages"][0]["content"] for b in stub.bodies}
    assert systems == {f"{route.SYSTEM_PROMPT}\n\nthe end.\n\npassage one",
                       f"{route.SYSTEM_PROMPT}\n\nthe end.\n\npassage two"}


def test_the_event_counter_counts_each_replica_s_announced_blocks_per_medium():
    import time

    import msgpack
    import zmq

    from kvtier.ports import free_port

    class Publisher:  # a replica's stream as vLLM sends it: (topic, seq, msgpack [ts, events, dp_rank])
        def __init__(self) -> None:
            self.endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.sock = zmq.Context.instance().socket(zmq.PUB)
            self.sock.bind(self.endpoint)

        def publish(self, events: list[dict]) -> None:
            self.sock.send_multipart((b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, events, 0])))

    def stored_chain(tokens: list[int], first: int, size: int, medium: str) -> list[dict]:
        return [{"type": "BlockStored", "block_hashes": [first + i], "parent_block_hash": None,
                 "token_ids": tokens[i * size:(i + 1) * size], "block_size": size, "medium": medium}
                for i in range(len(tokens) // size)]

    pubs = [Publisher(), Publisher()]
    with route.EventCounter([p.endpoint for p in pubs]) as counter:
        deadline = time.monotonic() + 10
        while counter.counts[0]["stored"].get("GPU", 0) == 0 and time.monotonic() < deadline:
            pubs[0].publish(stored_chain(list(range(8)), 1, 4, "GPU"))  # until the subscription is up
            time.sleep(0.05)
        before = counter.counts[0]["stored"]["GPU"]
        pubs[0].publish(stored_chain(list(range(12)), 10, 4, "CPU_TIER") + [
            {"type": "BlockRemoved", "block_hashes": [10, 11], "medium": "CPU_TIER"}, {"type": "AllBlocksCleared"}])
        pubs[1].publish([{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}])
        while (counter.counts[0]["removed"], counter.counts[1]["removed"]) != ({"CPU_TIER": 2}, {"GPU": 1}) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    assert before % 2 == 0 and counter.counts[0]["stored"] == {"GPU": before, "CPU_TIER": 3}
    assert counter.counts[0]["removed"] == {"CPU_TIER": 2} and counter.counts[1] == {"stored": {}, "removed": {"GPU": 1}}
    for pub in pubs:
        pub.sock.close(0)


def test_moved_turns_and_the_floor_of_a_recorded_trace(tmp_path):
    routed = {(0, 0): "a", (0, 1): "a", (0, 2): "b", (0, 3): "b", (1, 0): "b", (1, 1): "a", (1, 2): ""}
    assert route.moved_turns(routed) == 2  # (0, 2) and (1, 1); an unknown replica is not a move
    shared, user = list(range(64)), [[100 + u] * 40 for u in range(2)]
    prompts = {(u, 0): shared + user[u] for u in range(2)} | {(0, 1): shared + user[0] + [7] * 30}
    result = route.RouteResult(name="r", wall_s=0.0)
    for i, key in enumerate(sorted(prompts)):
        result.turns[key] = route.TurnClock().turn([1], 0.0)
        result.turns[key].start_s = float(i)
    route._record_trace(prompts, result, tmp_path / "t.jsonl", 1)
    # (0,0) computes 104; (0,1) reuses its 3 full blocks (96 tokens) and computes 38; (1,0) reuses the shared 64
    assert route.floor_tokens(tmp_path / "t.jsonl") == 104 + (134 - 96) + (104 - 64)
