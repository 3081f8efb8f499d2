"""The OpenAI client against the real serve-model server (a subprocess on a free port),
plus a named fake server for failure modes a healthy server never shows (5xx, drops)."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tasks.rollout.base import SamplingParams
from tasks.rollout.config import LocalConfig, OpenAIConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.openai_client import OpenAIBackend, OpenAIBackendError
from tasks.rollout.repetition import repetition_cut
from tasks.rollout.server import ServerProcess, free_port
from tasks.rollout.tiny_model import tiny_llama_path

PROMPTS = ["What is 3 + 4?", "def f(x):\n    return", "hello there", "the of and"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_llama_path(home=tmp_path_factory.getbasetemp() / "shared-models-home")


@pytest.fixture(scope="module")
def server(tiny_path):
    with ServerProcess(tiny_path, threads=1) as srv:
        yield srv
    assert srv.proc.poll() is not None  # stopped by pid at the end


@pytest.fixture(scope="module")
def client(server, tiny_path):
    backend = OpenAIBackend(OpenAIConfig(base_url=server.base_url, tokenizer=str(tiny_path),
                                         concurrency=2, prompts_per_request=2))
    yield backend
    backend.close()


def test_health_and_models_endpoints(server, tiny_path):
    assert httpx.get(f"http://127.0.0.1:{server.port}/health").json()["status"] == "ok"
    models = httpx.get(f"{server.base_url}/models").json()["data"]
    assert models[0]["id"] == tiny_path.name


def test_client_returns_n_completions_with_token_ids_and_logprobs(client):
    out = client.generate(PROMPTS, SamplingParams(n=3, max_tokens=10, seed=5))
    assert [len(per_prompt) for per_prompt in out] == [3] * len(PROMPTS)
    for completion in (c for per_prompt in out for c in per_prompt):
        assert 1 <= len(completion.token_ids) <= 10
        assert len(completion.logprobs) == len(completion.token_ids)
        assert completion.finish_reason in ("stop", "length")


def test_greedy_through_the_server_equals_the_local_backend(client, tiny_path):
    local = LocalBackend.from_path(tiny_path, LocalConfig(batch_size=8))
    params = SamplingParams(n=1, max_tokens=12, temperature=0)
    remote = client.generate(PROMPTS, params)
    direct = local.generate(PROMPTS, params)
    assert [c[0].token_ids for c in remote] == [c[0].token_ids for c in direct]
    assert [c[0].text for c in remote] == [c[0].text for c in direct]
    assert client.format_chat([{"role": "user", "content": "hi"}]) == local.format_chat([{"role": "user", "content": "hi"}])


def test_repetition_rule_is_applied_from_returned_logprobs(client):
    params = SamplingParams(n=2, max_tokens=30, temperature=0.02, repetition_window=5, repetition_prob=0.99)
    out = client.generate(PROMPTS, params)
    truncated = [c for per_prompt in out for c in per_prompt if c.truncated]
    assert truncated
    for completion in truncated:
        assert len(completion.token_ids) == len(completion.logprobs)
        assert repetition_cut(completion.logprobs, 5, 0.99) == len(completion.logprobs)


def test_unknown_model_is_a_clear_client_error_without_retries(server):
    backend = OpenAIBackend(OpenAIConfig(base_url=server.base_url, served_model="other-model", max_retries=3,
                                         backoff_s=5.0))
    with pytest.raises(OpenAIBackendError, match=r"after 1 attempt\(s\): HTTP 404.*not served here"):
        backend.generate(["hi"], SamplingParams(max_tokens=2))


class FlakyServer(BaseHTTPRequestHandler):
    """FAKE server: fails the first ``failures`` completion calls with 503, then answers."""

    failures = 2
    calls = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls <= type(self).failures:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        choices = [{"index": i, "text": "ok", "finish_reason": "stop", "token_ids": [1],
                    "logprobs": {"tokens": ["ok"], "token_logprobs": [-0.1]}}
                   for i in range(body["n"] * len(body["prompt"]))]
        payload = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def test_5xx_is_retried_with_backoff_then_succeeds():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = OpenAIConfig(base_url=f"http://127.0.0.1:{httpd.server_port}/v1", served_model="fake",
                           max_retries=3, backoff_s=0.01)
        out = OpenAIBackend(cfg).generate(["a"], SamplingParams(n=2, max_tokens=1))
        assert [c.text for c in out[0]] == ["ok", "ok"] and FlakyServer.calls == 3
        FlakyServer.calls, FlakyServer.failures = 0, 10
        with pytest.raises(OpenAIBackendError, match=r"after 2 attempt\(s\): HTTP 503"):
            OpenAIBackend(cfg.model_copy(update={"max_retries": 1})).generate(["a"], SamplingParams(max_tokens=1))
    finally:
        httpd.shutdown()


def test_connection_errors_are_retried_then_reported():
    cfg = OpenAIConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", served_model="m", max_retries=2, backoff_s=0.01)
    with pytest.raises(OpenAIBackendError, match=r"after 3 attempt\(s\): ConnectError"):
        OpenAIBackend(cfg).generate(["a"], SamplingParams(max_tokens=1))
