"""`AsyncEngine`: the engine's step loop on one background thread, streams for asyncio callers.

Callers never touch the `LLMEngine`: `generate` sends an "add" command and awaits the outputs the
loop thread pushes into the request's asyncio queue; leaving the iterator early (client gone,
task cancelled) sends "abort". A request the engine failed (finish_reason "error") raises
`RequestFailedError` in its own stream only; a step that raises anyway fails the running requests,
never the waiting ones, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvtier import openmp
from kvtier.engine.engine import LLMEngine, RequestOutput
from kvtier.engine.sequence import SamplingParams
from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine shut down or failed while the request was in it."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its sampling, admission or step); the others went on."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        """Start the loop thread. The calling thread gives back its OpenMP team (loading the model made
        one): the forward moves to the loop thread, and a second team would throttle both teams' threads
        into sleeping between the forward's parallel regions (`kvtier.openmp`)."""
        if self._thread is None:
            openmp.release_team()
            self._thread = named_thread(self._loop, "kvtier-engine")
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for request_id in list(self._streams):
            self._push(request_id, EngineDeadError("the engine shut down"))

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       namespace: str = "") -> AsyncIterator[RequestOutput]:
        if self._stopping or self._thread is None:
            raise EngineDeadError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, list(prompt_token_ids), sampling, namespace))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.finish_reason == "error":
                    raise RequestFailedError(item.error or "the engine failed this request")
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the loop thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 — a bad step must not take the server down
                log.exception("engine step failed; aborting the running requests")
                self._abort_running(exc)
                continue
            for output in outputs:
                self._push(output.request_id, output)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, sampling, namespace = command
                try:
                    self.engine.add_request(request_id, prompt, sampling, namespace)
                except Exception as exc:  # noqa: BLE001 — refused (ValueError) or broken: tell that caller only
                    self._push(request_id, exc)
            else:
                self.engine.abort_request(command[1])

    def _abort_running(self, exc: Exception) -> None:
        """The step raised past the engine's own isolation: the requests that were in it go (all of
        them only if none was running, so a failure outside any sequence cannot spin forever)."""
        for request_id in self.engine.running_request_ids() or self.engine.request_ids():
            self.engine.abort_request(request_id)
            self._push(request_id, RequestFailedError(f"engine step failed: {exc}"))

    def _push(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass
