"""A byte-level tokenizer for models without one (the tiny random test models: vocab 256)."""

from __future__ import annotations


class ByteTokenizer:
    """Token id = UTF-8 byte; decoding replaces a cut multi-byte character with U+FFFD."""

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, return_dict: bool = False, **kwargs) -> list[int] | str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text
