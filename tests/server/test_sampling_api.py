"""Logprobs, echo, n / best_of, batched prompts and the vLLM sampling fields through the HTTP API
(tiny model, byte tokenizer: token id = byte), parsed by the official `openai` client where it has a
type for them; logprobs against transformers' log_softmax of the same forward."""

import json

import httpx
import openai
import pytest
import torch


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": "tiny", "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def as_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


PROMPT = "To be, or not to be"


def test_completion_echo_logprobs_equal_transformers(tiny_server, tiny_model):
    url, _ = tiny_server
    done = client_of(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                             logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    choice = done.choices[0]
    lp = choice.logprobs  # openai's Logprobs type
    ids = as_ids(lp.tokens)
    prompt_ids = list(PROMPT.encode())
    assert ids[:len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 6
    assert choice.text.startswith(PROMPT) and done.usage.completion_tokens == 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_log_softmax(tiny_model.model, ids)
    diffs = []
    for i in range(1, len(ids)):
        row = ref[i - 1]
        diffs.append(abs(lp.token_logprobs[i] - row[ids[i]].item()))
        top = {int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[i].items()}
        want = set(row.topk(3).indices.tolist()) | {ids[i]}  # the top 3 and the token itself
        assert set(top) == want
        diffs += [abs(v - row[t].item()) for t, v in top.items()]
    assert max(diffs) < 1e-4, max(diffs)
    # greedy: each generated token is the most likely one
    assert all(max(lp.top_logprobs[i].values()) == lp.token_logprobs[i] for i in range(len(prompt_ids), len(ids)))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_chat_logprobs_parse_and_equal_transformers(tiny_server, tiny_model):
    url, app = tiny_server
    messages = [{"role": "user", "content": "Speak, Horatio."}]
    done = client_of(url).chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=2,
                                                  extra_body={"return_token_ids": True})
    content = done.choices[0].logprobs.content  # openai's ChatCompletionTokenLogprob items
    generated = done.choices[0].model_extra["token_ids"]
    prompt_ids = done.model_extra["prompt_token_ids"]
    assert prompt_ids == app.state.kvtier.tokenizer.apply_chat_template(messages)
    assert len(content) == len(generated) == 5
    ref = hf_log_softmax(tiny_model.model, prompt_ids + generated)
    for k, item in enumerate(content):
        row = ref[len(prompt_ids) + k - 1]
        assert abs(item.logprob - row[generated[k]].item()) < 1e-4
        assert [abs(t.logprob - v) < 1e-4 for t, v in zip(item.top_logprobs, row.topk(2).values.tolist())] == [True] * 2
        assert item.bytes == list(item.token.encode())
    plain = client_of(url).chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content


def test_streamed_logprobs_equal_the_whole_response(tiny_server):
    url, _ = tiny_server
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
    whole = post(url, "/v1/completions", body)["choices"][0]
    chunks = [c["choices"][0] for c in sse(url, "/v1/completions", body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole["logprobs"]
    two = sse(url, "/v1/completions", {**body, "n": 2})  # greedy: both choices are the whole response
    for j in range(2):
        mine = [c["choices"][0] for c in two if c["choices"] and c["choices"][0]["index"] == j]
        assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
        assert "".join(c["text"] for c in mine) == whole["text"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 1}
    whole_chat = post(url, "/v1/chat/completions", chat)["choices"][0]
    streamed = [item for c in sse(url, "/v1/chat/completions", chat) if c["choices"] and c["choices"][0]["logprobs"]
                for item in c["choices"][0]["logprobs"]["content"]]
    # the same tokens; the logprobs to float rounding: the second request's prompt comes from the prefix cache, so its
    # last rows are computed in a smaller step, whose linears take the few-rows kernel (another summation order)
    assert [t["token"] for t in streamed] == [t["token"] for t in whole_chat["logprobs"]["content"]]
    def numbers(items):
        return [x for t in items for x in (t["logprob"], *(top["logprob"] for top in t["top_logprobs"]))]
    assert numbers(streamed) == pytest.approx(numbers(whole_chat["logprobs"]["content"]), rel=1e-5, abs=1e-6)


def test_vllm_prompt_logprobs(tiny_server, tiny_model):
    url, _ = tiny_server
    done = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    entries = done["choices"][0]["prompt_logprobs"]
    ids = list(PROMPT.encode())
    ref = hf_log_softmax(tiny_model.model, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        mine = entries[i][str(ids[i])]
        assert abs(mine["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert mine["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert {int(k) for k in entries[i]} == set(ref[i - 1].topk(2).indices.tolist()) | {ids[i]}


def test_n_choices_are_seeds_in_a_row_and_best_of_takes_the_likeliest(tiny_server):
    url, _ = tiny_server
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "return_token_ids": True}
    many = post(url, "/v1/completions", {**body, "n": 3, "seed": 11})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2] and many["usage"]["completion_tokens"] == 18
    alone = [post(url, "/v1/completions", {**body, "seed": 11 + j, "logprobs": 0})["choices"][0] for j in range(3)]
    assert [c["token_ids"] for c in many["choices"]] == [c["token_ids"] for c in alone]
    assert len({tuple(c["token_ids"]) for c in alone}) == 3
    best = post(url, "/v1/completions", {**body, "n": 1, "best_of": 3, "seed": 11})["choices"]
    likeliest = max(alone, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    assert [c["token_ids"] for c in best] == [likeliest["token_ids"]] and best[0]["logprobs"] is None
    streamed = sse(url, "/v1/completions", {**body, "n": 3, "seed": 11})
    texts = ["".join(c["choices"][0]["text"] for c in streamed if c["choices"] and c["choices"][0]["index"] == j)
             for j in range(3)]
    assert texts == [c["text"] for c in many["choices"]]


def test_a_batch_of_prompts_gives_choices_in_order(tiny_server):
    url, _ = tiny_server
    one = [post(url, "/v1/completions", {"prompt": p, "max_tokens": 4, "temperature": 0})["choices"][0]["text"]
           for p in ("Speak", "Hold")]
    batch = post(url, "/v1/completions", {"prompt": ["Speak", list(b"Hold")], "max_tokens": 4, "temperature": 0,
                                          "n": 2})
    assert [(c["index"], c["text"]) for c in batch["choices"]] == [(0, one[0]), (1, one[0]), (2, one[1]), (3, one[1])]
    assert batch["usage"]["prompt_tokens"] == 2 * (5 + 4) and batch["usage"]["completion_tokens"] == 16


def test_logit_bias_penalties_and_stop_token_fields_act(tiny_server):
    url, _ = tiny_server
    greedy = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    assert post(url, "/v1/completions", {**greedy, "logit_bias": {"65": 100}})["choices"][0]["text"] == "A" * 24
    plain = post(url, "/v1/completions", greedy)["choices"][0]["token_ids"]
    assert len(set(plain)) < 24  # the tiny model repeats itself here...
    for penalty in ("presence_penalty", "frequency_penalty"):  # ...and a penalty of 2 outweighs its logits
        assert len(set(post(url, "/v1/completions", {**greedy, penalty: 2.0})["choices"][0]["token_ids"])) == 24
    stop = post(url, "/v1/completions", {**greedy, "stop_token_ids": [plain[1]]})["choices"][0]
    assert stop["token_ids"] == plain[:2] and stop["finish_reason"] == "stop"
    late = post(url, "/v1/completions", {**greedy, "stop_token_ids": [plain[0]], "min_tokens": 3})["choices"][0]
    assert plain[0] not in late["token_ids"][:3] and len(late["token_ids"]) > 3
    allowed = post(url, "/v1/completions", {**greedy, "allowed_token_ids": [66, 67]})["choices"][0]
    assert set(allowed["text"]) <= {"B", "C"} and len(allowed["text"]) == 24


def test_text_fields_act(tiny_server):
    url, _ = tiny_server
    greedy = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    text = post(url, "/v1/completions", greedy)["choices"][0]["text"]
    stop = text[3:5]
    cut = post(url, "/v1/completions", {**greedy, "stop": [stop]})["choices"][0]["text"]
    kept = post(url, "/v1/completions", {**greedy, "stop": [stop], "include_stop_str_in_output": True})
    assert cut == text[:text.index(stop)] and kept["choices"][0]["text"] == cut + stop
    short = post(url, "/v1/completions", {**greedy, "truncate_prompt_tokens": 5, "echo": True, "request_id": "r1"})
    assert short["usage"]["prompt_tokens"] == 5 and short["choices"][0]["text"].startswith(PROMPT[-5:])
    assert short["id"] == "cmpl-r1"
