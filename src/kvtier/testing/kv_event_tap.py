"""`python -m kvtier.testing.kv_event_tap ENDPOINT FILE`: append every KV event batch a vLLM publisher
(`--kv-events-config`) sends to FILE, one JSON line each: [seq, ts, events]. For tests; needs pyzmq and
msgspec (`.venv-vllm` has both, as vLLM's publisher uses them)."""

from __future__ import annotations

import json
import sys

import msgspec
import zmq


def main(endpoint: str, out_path: str) -> None:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    with open(out_path, "a") as out:
        while True:
            _, seq, payload = sock.recv_multipart()
            ts, events, *_ = msgspec.msgpack.decode(payload)
            out.write(json.dumps([int.from_bytes(seq, "big"), ts, events]) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
