"""Requests of the OpenAI API checked into engine inputs (batchmaker/serving/openai_api.py), without a
server: every mistake is an ApiError naming its parameter, unknown and unimplemented parameters are
refused rather than ignored, and each choice's engine inputs (its prompt, limits, derived seed)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
from batchmaker.serving.chat_template import ChatTemplate  # noqa: E402
from batchmaker.serving.openai_api import ApiError, choice_seed, parse_request  # noqa: E402
from batchmaker.serving.text_model import TextModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tiny_checkpoint import CHAT_TEMPLATE, train_tokenizer  # noqa: E402

TOKENIZER = train_tokenizer()
BOS, EOS, IM_END = (TOKENIZER.token_to_id(t) for t in ("<s>", "</s>", "<|im_end|>"))
MODEL = TextModel("tiny", TOKENIZER, ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}),
                  max_positions=64, vocab_size=TOKENIZER.get_vocab_size(), eos_ids=(EOS, IM_END), created=0)
MODELS, OTHERS = {"tiny": MODEL}, {"lstm"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
TEXT = {"model": "tiny", "prompt": "The engine"}


def parse(kind: str, body):
    return parse_request(kind, body, MODELS, OTHERS)


def refused(kind: str, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(kind, body)
    error = caught.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return caught.value


@pytest.mark.parametrize("body, status, param, code", [
    ([1, 2], 400, None, None),
    ({"messages": CHAT["messages"]}, 400, "model", None),
    ({**CHAT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ({**CHAT, "model": "lstm"}, 400, "model", None),  # served, but not over HTTP
    ({"model": "tiny"}, 400, "messages", None),
    ({**CHAT, "messages": []}, 400, "messages", None),
    ({**CHAT, "messages": [{"content": "no role"}]}, 400, "messages[0].role", None),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content", None),
    ({**CHAT, "messages": [{"role": "robot", "content": "beep"}]}, 400, "messages", None),  # the template refuses
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "bogus": 1}]}, 400, "messages[0].bogus", None),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": 7}]}, 400, "messages[0].name", None),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[0].tool_calls", "unsupported_parameter"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     400, "messages[0].function_call", "unsupported_parameter"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     400, "messages[1].tool_call_id", "unsupported_parameter"),
    ({**CHAT, "max_tokens": -1}, 400, "max_tokens", None),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ({**CHAT, "max_tokens": 2.5}, 400, "max_tokens", None),
    ({**CHAT, "max_completion_tokens": 8, "max_tokens": 9}, 400, "max_completion_tokens", None),
    ({**CHAT, "max_tokens": 60}, 400, "max_tokens", "context_length_exceeded"),  # the prompt has 9
    ({**TEXT, "prompt": "w " * 80}, 400, "prompt", "context_length_exceeded"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ({**CHAT, "temperature": 2.5}, 400, "temperature", None),
    ({**CHAT, "top_p": 0}, 400, "top_p", None),
    ({**CHAT, "top_k": -2}, 400, "top_k", None),
    ({**CHAT, "n": 0}, 400, "n", None),
    ({**TEXT, "prompt": ["a"] * 5, "n": 30}, 400, "n", None),
    ({**CHAT, "seed": 2**63}, 400, "seed", None),
    ({**CHAT, "stop": ""}, 400, "stop", None),
    ({**CHAT, "stop": ["a", 1]}, 400, "stop", None),
    ({**CHAT, "stop_token_ids": [1] * 7}, 400, "stop_token_ids", None),  # 8 with the model's 2 EOS ids
    ({**CHAT, "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    ({**CHAT, "ignore_eos": 1}, 400, "ignore_eos", None),
    ({**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", None),  # without stream
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options", None),
    ({**CHAT, "logprobs": 1}, 400, "logprobs", None),  # (chat's is a bool)
    ({**CHAT, "top_logprobs": 3}, 400, "top_logprobs", None),  # (without logprobs true)
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ({**TEXT, "logprobs": True}, 400, "logprobs", None),  # (completions' is a count)
    ({**TEXT, "logprobs": -1}, 400, "logprobs", None),
    ({**CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_parameter"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter"),
    ({**TEXT, "echo": True}, 400, "echo", "unsupported_parameter"),
    ({**CHAT, "prompt": "chat takes messages"}, 400, "prompt", None),
    ({**CHAT, "reasoning_effort": "high"}, 400, "reasoning_effort", None),
    ({**CHAT, "made_up": 1}, 400, "made_up", None),
    ({**TEXT, "prompt": ""}, None, None, None),  # (a BOS alone: allowed)
    ({**TEXT, "prompt": []}, 400, "prompt", None),
    ({**TEXT, "prompt": [1, 10**6]}, 400, "prompt", None),
    ({**TEXT, "prompt": [[1], []]}, 400, "prompt", None),
    ({**TEXT, "prompt": [True, 2]}, 400, "prompt", None),
])
def test_a_mistake_is_an_api_error_naming_its_parameter(body, status, param, code):
    kind = "text_completion" if isinstance(body, dict) and "prompt" in body and "messages" not in body \
        else "chat.completion"
    if status is None:
        parse(kind, body)
        return
    error = refused(kind, body)
    assert (error.status, error.param, error.code) == (status, param, code)
    assert error.body()["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_off_values_of_unimplemented_parameters_are_accepted():
    off = {"logprobs": False, "top_logprobs": 0, "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {},
           "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "user": "alice", "n": None}
    assert parse("chat.completion", {**CHAT, **off}).n == 1
    assert parse("text_completion", {**TEXT, "echo": False, "suffix": None, "best_of": 1, "logprobs": None}).n == 1
    # messages: a name, and OpenAI's fields this front does not implement when absent in all but name (a client
    # resending a reply's message as it parsed it)
    named = parse("chat.completion", {**CHAT, "messages": [{"role": "user", "content": "Hello", "name": "alice"}]})
    resent = {"role": "assistant", "content": "Hi", "tool_calls": None, "function_call": None, "refusal": None,
              "audio": None}
    assert parse("chat.completion", {**CHAT, "messages": [*CHAT["messages"], resent, *CHAT["messages"]]}).n == 1
    assert named.prompts == parse("chat.completion", CHAT).prompts  # (the template does not write names)


def test_a_chat_request_becomes_the_templates_prompt_and_the_engines_inputs():
    request = parse("chat.completion", {**CHAT, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "seed": 7,
                                        "stop": "END", "stop_token_ids": [9], "max_completion_tokens": 4})
    want = TOKENIZER.encode("<s><|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False).ids
    assert request.prompts == (tuple(want),) and want[0] == BOS
    assert request.engine_inputs(0) == {"tokens": want, "max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                                        "top_k": 5, "ignore_eos": False, "stop_token_ids": [9], "seed": 7}
    assert request.stops == ("END",) and request.stop_ids == {EOS, IM_END, 9}
    assert not parse("chat.completion", {**CHAT, "ignore_eos": True}).stop_ids
    default = parse("chat.completion", CHAT)
    assert default.engine_inputs(0)["max_new_tokens"] == 64 - len(want)  # until the context is full
    assert default.engine_inputs(0)["temperature"] == 1.0 and "seed" not in default.engine_inputs(0)


def test_completion_prompts_and_choices():
    request = parse("text_completion", {**TEXT, "prompt": ["a b", [5, 6, 7]], "n": 3, "seed": 11})
    assert request.num_choices == 6
    assert request.prompts == (tuple(TOKENIZER.encode("a b").ids), (5, 6, 7)) and request.prompts[0][0] == BOS
    assert [request.prompt_of(i) for i in range(6)] == [request.prompts[0]] * 3 + [request.prompts[1]] * 3
    seeds = [request.engine_inputs(i)["seed"] for i in range(6)]
    assert seeds[0] == 11 and len(set(seeds)) == 6
    assert request.engine_inputs(0)["max_new_tokens"] == 16  # OpenAI's default
    long = parse("text_completion", {**TEXT, "prompt": [5] * 60})
    assert long.engine_inputs(0)["max_new_tokens"] == 4  # what the context leaves


def test_choice_seeds_are_distinct_int64s_and_the_same_every_time():
    for seed in (0, 1, -1, 2**63 - 1, -(2**63)):
        seeds = [choice_seed(seed, i) for i in range(128)]
        assert seeds[0] == seed and len(set(seeds)) == 128
        assert all(-(2**63) <= s < 2**63 for s in seeds)
        assert seeds == [choice_seed(seed, i) for i in range(128)]


@pytest.mark.parametrize("kind", ["chat.completion", "text_completion"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_text_chunk_is_the_json_of_its_fields(kind, include_usage):
    import json

    from batchmaker.serving.openai_replies import Replies

    body = {**CHAT, "stream": True} if kind == "chat.completion" else {**TEXT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    replies = Replies(parse(kind, body))
    text = 'a "quoted" naïve 🙂\n\\'
    chunk = replies.delta(3, text)
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    got = json.loads(chunk[len(b"data: "):])
    choice = {"index": 3, "logprobs": None, "finish_reason": None,
              **({"delta": {"content": text}} if kind == "chat.completion" else {"text": text})}
    assert got == {"id": replies.id, "object": "chat.completion.chunk" if kind == "chat.completion" else kind,
                   "created": replies.created, "model": "tiny", "choices": [choice],
                   **({"usage": None} if include_usage else {})}
    last = json.loads(replies.delta(3, "", "stop")[len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "stop"


def test_logprobs_become_the_engines_input():
    assert parse("chat.completion", {**CHAT, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert parse("chat.completion", {**CHAT, "logprobs": True}).logprobs == 0
    assert parse("chat.completion", {**CHAT, "logprobs": False}).logprobs == -1
    request = parse("text_completion", {**TEXT, "logprobs": 0})
    assert request.logprobs == 0 and request.engine_inputs(0)["logprobs"] == 0
    assert "logprobs" not in parse("text_completion", TEXT).engine_inputs(0)


def test_chat_logprobs_bytes_are_each_tokens_own_where_a_character_is_split():
    from batchmaker.serving.openai_replies import Replies

    ids = TOKENIZER.encode("🙂 é", add_special_tokens=False).ids  # (byte tokens: 🙂 is four, é two)
    scores = [(t, -0.5, [[t, -0.5], [EOS, -3.0]]) for t in ids]
    replies = Replies(parse("chat.completion", {**CHAT, "logprobs": True, "top_logprobs": 2}))
    content = replies.logprobs(0, scores)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == "🙂 é".encode()
    assert content[0]["bytes"] == [0xF0] and content[0]["token"] == "\ufffd"  # (its text alone: U+FFFD)
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]
