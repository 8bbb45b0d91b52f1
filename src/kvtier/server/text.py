"""Token ids in, text deltas out, with OpenAI's `stop` strings (vLLM's `include_stop_str_in_output`,
`skip_special_tokens`, and `min_tokens`: no stop string ends a completion shorter than that).

The whole completion is decoded on every step (completions are short next to the prompt), so a
multi-byte character split over two tokens comes out whole. A delta never ends in a half
character (U+FFFD from a cut UTF-8 sequence) or in a prefix of a stop string: that tail is held
back until the next tokens show whether it completes.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str], *, include_stop: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends before it
        self._num_emitted_chars = 0

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text that is now final."""
        assert not self.stopped, "tokens after a stop string"
        self.token_ids.extend(new_token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        cut = self._first_stop(text) if len(self.token_ids) >= self.min_tokens else None
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._emit(len(self.text))
        self.text = text
        return self._emit(len(text) - self._held_chars(text))

    def finish(self) -> str:
        """The held-back tail, once no more tokens come."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        delta = self.text[self._num_emitted_chars:end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return delta

    def _first_stop(self, text: str) -> int | None:
        # Only the unemitted part (plus a stop's length of context) can hold a new match.
        start = max(0, self._num_emitted_chars - max((len(s) for s in self.stops), default=0))
        hits = [(i, i + len(s)) for i, s in ((text.find(s, start), s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        first = min(hits)
        return first[1] if self.include_stop else first[0]

    def _held_chars(self, text: str) -> int:
        held = len(text) - len(text.rstrip(_REPLACEMENT))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held
