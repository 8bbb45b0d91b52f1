"""One request in the engine, as the HTTP layer sees it: engine outputs in, `Delta`s (text, token ids,
their logprobs) out.

`Generation.deltas()` drives `AsyncEngine.generate`, turns token ids into text (with stop
strings), observes TTFT and inter-token latency, and aborts the engine request whenever it ends
early: a stop string, an error, or the client going away (the HTTP task is cancelled; for a
non-streaming request by the app's disconnect watcher). A request the engine failed alone raises
`RequestFailedError` and is counted with finish reason "error".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from kvtier.engine import RequestFailedError
from kvtier.engine.sequence import TokenLogprob
from kvtier.server.metrics import ServerMetrics
from kvtier.server.protocol import usage
from kvtier.server.text import TextStream


class EngineAbortedError(RuntimeError):
    """The engine ended the request on its own (shutdown, or it could never fit)."""


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when asked for
    first: bool = False  # the first delta: the prompt's logprobs are in `Generation.prompt_logprobs` by now


class Generation:
    def __init__(self, async_engine, tokenizer, metrics: ServerMetrics, *, request_id: str,
                 prompt_token_ids: list[int], sampling, namespace: str, stops: list[str],
                 started_at: float, on_finish=None, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.async_engine = async_engine
        self.metrics = metrics
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.namespace = namespace
        self.started_at = started_at
        self.text = TextStream(tokenizer, stops, include_stop=include_stop, skip_special_tokens=skip_special_tokens,
                               min_tokens=sampling.min_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.failed = False  # the engine finished it with an error
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0
        self.offload = None  # OffloadStats of a request longer than the device (the engine's last word)
        self.on_finish = on_finish  # called with this Generation once it finished normally

    def usage(self) -> dict:
        return usage(len(self.prompt_token_ids), self.num_generated_tokens, self.num_cached_tokens)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until the request finishes (one per engine output with text, or with logprobs when
        they were asked for); `finish_reason` is set when this ends normally."""
        outputs = self.async_engine.generate(self.request_id, self.prompt_token_ids, self.sampling,
                                             namespace=self.namespace)
        engine_done = False
        last_token_at: float | None = None
        try:
            async for out in outputs:
                now = time.perf_counter()
                self.metrics.observe_tokens(self.started_at, last_token_at, now, len(out.new_token_ids))
                last_token_at = now if out.new_token_ids else last_token_at
                self.num_cached_tokens = out.num_cached_tokens
                self.offload = out.offload
                self.num_generated_tokens += len(out.new_token_ids)
                self.token_ids += out.new_token_ids
                self.logprobs += out.logprobs or []
                first = out.prompt_logprobs is not None or self.num_generated_tokens == len(out.new_token_ids)
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                delta = self.text.add(out.new_token_ids)
                engine_done = out.finished
                if self.text.stopped:
                    self.finish_reason = "stop"
                elif out.finished:
                    if out.finish_reason == "abort":
                        raise EngineAbortedError(f"request {self.request_id} was aborted by the engine")
                    self.finish_reason = out.finish_reason
                    delta += self.text.finish()
                if delta or (out.logprobs and self.sampling.logprobs is not None) or first:
                    yield Delta(delta, list(out.new_token_ids), list(out.logprobs or []), first)
                if self.finish_reason is not None:
                    break
        except RequestFailedError:
            engine_done = self.failed = True
            raise
        finally:
            # Shielded: when the client disconnects this task is cancelled, and every await in an
            # anyio-cancelled scope would be cancelled again before the engine heard of it.
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await outputs.aclose()
                if not engine_done:
                    await self.async_engine.abort(self.request_id)
            self._count_finished()
            if self.finish_reason is not None and self.on_finish is not None:
                self.on_finish(self)

    def _count_finished(self) -> None:
        reason = self.finish_reason or ("error" if self.failed else "abort")
        self.metrics.observe_finished(reason, len(self.prompt_token_ids),
                                      self.num_cached_tokens, self.num_generated_tokens)

    async def collect(self) -> str:
        return "".join([delta.text async for delta in self.deltas()])
