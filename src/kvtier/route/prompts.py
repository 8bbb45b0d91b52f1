"""A request's prompt token ids, as the replicas compute them, so the selector's block hashes are theirs.

vLLM 0.32 and `kvtier serve` tokenize alike: a completion's `prompt` string is encoded with
`add_special_tokens` (default true; token-id prompts are taken as they are); a chat request's messages are
rendered by the model's chat template to text (`add_generation_prompt` default true,
`continue_final_message`, `chat_template_kwargs`, `tools`), then encoded with `add_special_tokens` default
false. A message whose content is a list of parts becomes its text parts joined by newlines (vLLM's
"string" content format). A body this cannot read gives None: the replica answers it (usually its 400).
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The replicas' model tokenizer (a local model directory or a hub id already in the cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text")
    raise ValueError("message content is neither a string nor a list of parts")


def chat_token_ids(tokenizer, body: dict) -> list[int]:
    messages = [{**m, "content": _text(m.get("content") or "")} for m in body["messages"]]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("tools"):
        kwargs["tools"] = body["tools"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                         continue_final_message=body.get("continue_final_message", False),
                                         tokenize=False, **kwargs)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=body.get("add_special_tokens", False))]


def completion_token_ids(tokenizer, body: dict) -> list[int]:
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: the first prompt decides where the batch goes
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True))]


def prompt_token_ids(tokenizer, path: str, body) -> list[int] | None:
    """The token ids of `body` sent to `path` (`/v1/completions` or `/v1/chat/completions`), or None."""
    if tokenizer is None or not isinstance(body, dict):
        return None
    try:
        if path.endswith("/chat/completions"):
            return chat_token_ids(tokenizer, body)
        if path.endswith("/completions"):
            return completion_token_ids(tokenizer, body)
    except Exception:  # noqa: BLE001 — a body the replica will refuse, or a template that rejects it
        return None
    return None


def request_cache_salt(body) -> str | None:
    """The tenant a request names (`cache_salt`, vLLM's and kvtier serve's field), None when it names none or
    the body is not a request the replica will take (it answers that itself)."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None
