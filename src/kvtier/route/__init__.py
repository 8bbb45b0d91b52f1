"""`kvtier route`: an OpenAI-compatible router over N replicas (vLLM + kvtier, or `kvtier serve`).

`replicas.py` (each replica's state and back-off), `selectors.py` (round-robin, least-loaded, NVIDIA
Dynamo's selection service), `prompts.py` (token ids as the replicas compute them), `metrics.py`,
`app.py` (the forwarding app), `cli.py` (the command).
"""
