"""OpenAI parameters: each is honoured or refused with a 400 naming it; a field the server does
not know is ignored and named in the response; usage counts the returned text."""

from __future__ import annotations

import logging

import openai
import pytest

MODEL = "tiny-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

REFUSED = [  # (route, extra body fields, param, code)
    (CHAT, {"top_p": 2}, "top_p", "invalid_value"),
    (CHAT, {"top_p": 0}, "top_p", "invalid_value"),
    (CHAT, {"top_p": 0.5, "temperature": 0.7}, "top_p", "unsupported_value"),
    (CHAT, {"logprobs": True, "top_logprobs": 3}, "logprobs", "unsupported_parameter"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    (CHAT, {"top_logprobs": 21}, "top_logprobs", "invalid_value"),
    (CHAT, {"n": 2}, "n", "unsupported_parameter"),
    (CHAT, {"n": 0}, "n", "invalid_value"),
    (CHAT, {"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    (CHAT, {"presence_penalty": -3}, "presence_penalty", "invalid_value"),
    (CHAT, {"logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value"),
    (
        CHAT,
        {"response_format": {"type": "json_object"}},
        "response_format",
        "unsupported_parameter",
    ),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "unsupported_parameter",
    ),
    (CHAT, {"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    (CHAT, {"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter"),
    (CHAT, {"store": True}, "store", "unsupported_parameter"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    (COMPLETIONS, {"logprobs": 1}, "logprobs", "unsupported_parameter"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs", "invalid_value"),
    (COMPLETIONS, {"best_of": 2}, "best_of", "unsupported_parameter"),
    (COMPLETIONS, {"suffix": "The end."}, "suffix", "unsupported_parameter"),
]
NEUTRAL = {  # values that ask for nothing the server lacks
    "top_p": 1,
    "n": 1,
    "logprobs": False,
    "top_logprobs": None,
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "tools": [],
    "parallel_tool_calls": False,
    "store": False,
    "modalities": ["text"],
    "service_tier": "auto",
    "user": "u-1",
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}


def request(route: str, **fields) -> dict:
    key = {"messages": MESSAGES} if route == CHAT else {"prompt": "Hi"}
    return {"model": MODEL, "max_tokens": 6, **key, **fields}


@pytest.mark.parametrize(("route", "fields", "param", "code"), REFUSED)
def test_what_cannot_be_honoured_is_a_400_naming_it(http, route, fields, param, code):
    resp = http.post(route, json=request(route, **fields))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"].startswith(f"{param}: ")


def test_the_openai_client_sees_the_refusal(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3
        )
    assert err.value.body["param"] == "logprobs" and "log probabilities" in err.value.message


def test_unknown_fields_are_ignored_and_named(client, caplog):
    """vLLM's and llama.cpp's way: the answer is the plain one; the response's `oled` object
    and a header name what was ignored, and the server logs one warning line."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert plain.model_extra["oled"]["ignored_fields"] == []
    extra = {"vendor_extra": 1, "top_k": 5}
    with caplog.at_level(logging.WARNING, logger="oled.serve"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=extra
        )
    out = raw.parse()
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert out.model_extra["oled"]["ignored_fields"] == ["top_k", "vendor_extra"]
    assert raw.headers["oled-ignored-fields"] == "top_k, vendor_extra"
    [warning] = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert (
        warning.getMessage() == "/v1/chat/completions: ignored unknown fields: top_k, vendor_extra"
    )
    stream = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, stream=True, extra_body={"vendor_extra": 1}
    )
    [last] = [c for c in stream if c.choices and c.choices[0].finish_reason]
    assert last.model_extra["oled"]["ignored_fields"] == ["vendor_extra"]


def test_ignored_field_names_cannot_break_the_header(http):
    """Names with a comma, a line break or non-Latin letters are percent-encoded in the header
    (and in the warning line) and given as they are in the body."""
    names = ["a,b\r\nSet-Cookie: x=1", "名前"]
    resp = http.post(CHAT, json=request(CHAT, **dict.fromkeys(names, 1)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["oled"]["ignored_fields"] == sorted(names)
    assert (
        resp.headers["oled-ignored-fields"]
        == "a%2Cb%0D%0ASet-Cookie%3A%20x%3D1, %E5%90%8D%E5%89%8D"
    )
    assert "set-cookie" not in resp.headers


def test_known_parameters_stay_refused_beside_unknown_ones(http):
    resp = http.post(CHAT, json=request(CHAT, vendor_extra=1, logprobs=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"


def test_neutral_values_and_greedy_top_p_give_the_plain_answer(http):
    plain = http.post(CHAT, json=request(CHAT)).json()["choices"][0]["message"]["content"]
    for fields in (NEUTRAL, {"top_p": 0.1}, {"top_p": 0.1, "temperature": 0}):
        resp = http.post(CHAT, json=request(CHAT, **fields))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == plain


def test_usage_counts_the_tokens_of_the_returned_text(client):
    """With a stop string, the tokens decoded past it do not count: the count is the least
    max_tokens whose answer starts with the returned text."""
    extra = {"block_length": 8, "threshold": 0.5}
    whole = client.completions.create(model=MODEL, prompt="Hi", max_tokens=16, extra_body=extra)
    text = whole.choices[0].text
    assert len(text) >= 4, text
    stop = text[len(text) // 3 :][:2]
    cut = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=16, stop=[stop], extra_body=extra
    )
    returned = cut.choices[0].text
    assert cut.choices[0].finish_reason == "stop" and returned == text[: text.find(stop)]
    prefixes = [
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=n, extra_body=extra)
        .choices[0]
        .text
        for n in range(1, 17)
    ]
    tokens = next(n for n, t in enumerate(prefixes, 1) if t.startswith(returned)) if returned else 0
    assert cut.usage.completion_tokens == tokens
    assert cut.usage.completion_tokens < cut.model_extra["oled"]["tokens"]  # decoded past it
    stream = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=16,
        stop=[stop],
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(stream)[-1].usage.completion_tokens == cut.usage.completion_tokens
