import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running, tiny_app  # noqa: E402,F401


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """(base URL, app) of a server on the tiny model with a byte tokenizer and a DRAM tier."""
    app = tiny_app(tiny_model)
    with running(app) as url:
        yield url, app
