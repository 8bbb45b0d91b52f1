import pytest
import torch


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    """Different lengths; the last shares a 33-token prefix with the third (4 blocks of 8)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 40, 23, 30, 9)]
    return prompts + [prompts[2][:33] + [7, 8, 9]]
