"""Helpers shared by the engine and server tests."""

import torch


def reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy `model.generate` with the default DynamicCache (stops at EOS like the engine)."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
