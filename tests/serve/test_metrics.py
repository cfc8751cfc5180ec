"""`GET /metrics`: Prometheus exposition with HELP and TYPE, one registry per app."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from oled.serve.app import create_app
from oled.serve.engine import Engine

MODEL = "tiny-test"
FAMILIES = {
    "oled_http_requests": "counter",
    "oled_generations": "counter",
    "oled_prompt_tokens": "counter",
    "oled_completion_tokens": "counter",
    "oled_forwards": "counter",
    "oled_decode_seconds": "counter",
    "oled_client_disconnects": "counter",
    "oled_request_latency_seconds": "histogram",
    "oled_model_load_seconds": "gauge",
    "oled_model_ready": "gauge",
    "oled_queue_depth": "gauge",
    "oled_batch_size": "histogram",
    "oled_batch_requests": "gauge",
}


def scrape(url: str) -> str:
    resp = httpx.get(f"{url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return resp.text


def sample(text: str, name: str, **labels: str) -> float:
    """A sample's value in exposition text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_every_metric_has_help_and_type(server_url, http):
    before = scrape(server_url)
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5})
    text = scrape(server_url)
    helps = re.findall(r"^# HELP (\S+) \S", text, re.M)
    assert helps and helps == re.findall(r"^# TYPE (\S+) ", text, re.M)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: types.get(name) for name in FAMILIES} == FAMILIES
    assert sample(text, "oled_model_ready") == 1
    for name, grew in [
        ("oled_completion_tokens_total", out.json()["usage"]["completion_tokens"]),
        ("oled_prompt_tokens_total", out.json()["usage"]["prompt_tokens"]),
        ("oled_generations_total", 1),
        ("oled_request_latency_seconds_count", 1),
    ]:
        labels = {"finish_reason": "length"} if name == "oled_generations_total" else {}
        assert sample(text, name, **labels) - sample(before, name, **labels) == grew, name


def test_each_app_counts_on_its_own(tiny_dir, loader, start_server, server_url):
    """A second app in the same process registers the same names without a clash and counts
    only its own requests."""
    labels = {"route": "/v1/models", "status": "200"}
    shared = sample(scrape(server_url), "oled_http_requests_total", **labels)
    with start_server(create_app(Engine(loader(tiny_dir)), model_name=MODEL)) as url:
        for _ in range(3):
            assert httpx.get(f"{url}/v1/models").status_code == 200
        assert httpx.get(f"{url}/v1/models/{MODEL}").status_code == 200
        own = scrape(url)
    assert sample(own, "oled_http_requests_total", **labels) == 3
    model_route = {"route": "/v1/models/{model}", "status": "200"}
    assert sample(own, "oled_http_requests_total", **model_route) == 1
    assert sample(scrape(server_url), "oled_http_requests_total", **labels) == shared
