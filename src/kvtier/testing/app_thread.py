"""An ASGI app served by uvicorn in a thread of this process on a free 127.0.0.1 port (tests: stub
replicas, stub selectors, the router itself)."""

from __future__ import annotations

import threading
import time

from kvtier.ports import free_port


class AppThread:
    def __init__(self, app, *, name: str = "kvtier-app") -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def __enter__(self) -> AppThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.thread.name} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
