"""The OpenAI-compatible HTTP server in front of the engine (`kvtier serve`)."""
