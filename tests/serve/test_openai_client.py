"""The official openai client against a real server: chat, completions, streaming, usage."""

from __future__ import annotations

import threading

import openai
import pytest

MODEL = "tiny-test"


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "oled-moe")
    assert card.created == client.models.list().data[0].created


def test_retrieving_an_unknown_model_is_a_404(client, server_url):
    for name in ("gpt-4", "org/tiny-test"):
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(name)
        assert err.value.body == {
            "message": f"the model {name!r} does not exist; this server has {MODEL!r}",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    anonymous = openai.OpenAI(base_url=f"{server_url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.retrieve(MODEL)


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    extra = out.model_extra["oled"]
    assert extra["iterations"] >= 1 and extra["offload"] is None


def test_chat_stream_matches_whole_answer(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].model_extra["oled"]["tokens"] == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stream_without_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
    )
    assert all(c.usage is None for c in chunks) and chunks[-1].choices


def test_completions(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    parts = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completion_echo_and_token_prompt(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, echo=True)
    assert out.choices[0].text.startswith("Once upon")
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert ids.usage.prompt_tokens == 3


def test_stop_string_and_llada_extras(client):
    free = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=16, extra_body={"block_length": 4, "threshold": 0.5}
    )
    assert free.model_extra["oled"]["blocks"] >= 4
    text = free.choices[0].text
    assert len(text) > 2
    stop = text[1:3]
    cut = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=16,
        stop=[stop],
        extra_body={"block_length": 4, "threshold": 0.5},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]


def test_concurrent_clients(client):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            out = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Same"}],
                max_tokens=6,
                stream=bool(i % 2),
            )
            if i % 2:
                results[i] = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
            else:
                results[i] = out.choices[0].message.content
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors
    assert len(results) == 6 and len(set(results.values())) == 1  # greedy: same answer


def test_wrong_key_and_unknown_model(server_url, client):
    bad = openai.OpenAI(base_url=f"{server_url}/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5000
        )
    assert err.value.body["param"] == "max_tokens"
