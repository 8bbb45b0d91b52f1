"""vLLM's KV cache events (`--kv-events-config`) published by kvtier itself: the wire format (`wire.py`)
and the ZMQ publisher with its replay socket (`publisher.py`), without vLLM."""
