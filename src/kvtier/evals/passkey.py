"""Passkey retrieval: a 5-digit number hidden at a depth of repetitive filler text.

Prompt (the format of Mohtashami & Jaggi's landmark-attention passkey test, with the needle said
twice so that a 135M model can do it at full cache):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. ...
    The grass is green. The sky is blue. ... (filler up to `depth` of the context)
    The pass key is 12345. Remember it. 12345 is the pass key.
    The grass is green. ... (filler up to `num_tokens`)
    What is the pass key?
                                                        | cue: " The pass key is"

Protocol: the context (everything before the cue) is prefilled once in full precision and written
into the method's cache (quantized / evicted; SnapKV's observation window is the last 32 tokens of
the context, or with `--snapkv-window question` exactly the question's tokens). The cue is then fed
through the lossy cache and the answer is greedy-decoded for `max_new_tokens`; it is correct when the
first number in it equals the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key?"
CUE = " The pass key is"


@dataclass(slots=True)
class PasskeyPrompt:
    context_ids: torch.Tensor   # [1, n]
    cue_ids: torch.Tensor       # [1, c]
    passkey: int
    depth: float
    num_tokens: int      # context + cue, as tokenized
    target_tokens: int   # the length asked for (the filler comes in whole sentences)
    question_tokens: int = 0  # the question at the end of the context (SnapKV's window on the question)


def make_prompt(tokenizer, num_tokens: int, depth: float, passkey: int) -> PasskeyPrompt:
    """A prompt of about `num_tokens` tokens (context + cue) with the key at `depth` (0..1)."""
    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    fixed = count(INTRO + NEEDLE.format(key=passkey) + QUESTION + CUE)
    num_fillers = max(1, (num_tokens - fixed) // count(FILLER))
    before = round(num_fillers * depth)
    document = INTRO + FILLER * before + NEEDLE.format(key=passkey) + FILLER * (num_fillers - before)
    context_ids = tokenizer(document + QUESTION, return_tensors="pt").input_ids
    cue_ids = tokenizer(CUE, return_tensors="pt", add_special_tokens=False).input_ids
    question_tokens = context_ids.shape[1] - count(document)
    return PasskeyPrompt(context_ids, cue_ids, passkey, depth, context_ids.shape[1] + cue_ids.shape[1], num_tokens,
                         question_tokens)


def make_prompts(tokenizer, lengths: list[int], depths: list[float], seed: int = 0) -> list[PasskeyPrompt]:
    rng = random.Random(seed)
    return [make_prompt(tokenizer, n, d, rng.randint(10000, 99999)) for n in lengths for d in depths]


@torch.inference_mode()
def greedy_answer(model: torch.nn.Module, cache, cue_ids: torch.Tensor, max_new_tokens: int = 8) -> list[int]:
    """Feed the cue through `cache` (holding the context), then greedy-decode `max_new_tokens`."""
    token_ids: list[int] = []
    inputs = cue_ids
    for _ in range(max_new_tokens):
        logits = model(inputs, past_key_values=cache, use_cache=True).logits
        next_id = int(logits[0, -1].argmax())
        token_ids.append(next_id)
        inputs = torch.tensor([[next_id]], device=cue_ids.device)
    return token_ids


def is_correct(answer_text: str, passkey: int) -> bool:
    match = re.search(r"\d+", answer_text)
    return match is not None and match.group(0) == str(passkey)
