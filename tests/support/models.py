"""Model fixtures: tiny random Llama/Mistral for unit tests, the real SmolLM2 for marked tests."""

from __future__ import annotations

import pytest

from kvtier import models


@pytest.fixture(scope="session")
def tiny_model() -> models.LoadedModel:
    return models.load("tiny", device="cpu")


@pytest.fixture(scope="session")
def tiny_swa_model() -> models.LoadedModel:
    return models.load("tiny-swa", device="cpu")


@pytest.fixture(scope="session")
def smollm2() -> models.LoadedModel:
    """The embedded SmolLM2-135M-Instruct (converted from its GGUF once, then cached)."""
    return models.load("smollm2", device="cpu")
