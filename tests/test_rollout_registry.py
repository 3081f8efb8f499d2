"""A rollout backend is its module plus one entry in ``tasks.rollout.factory.BACKENDS`` (issue #34,
item 5): configuration accepts it, ``make_backend`` builds it, the judge's model resolution, the
references' engine sharing and the pipeline's per-device limit all read its registration. The
backend registered here is a real ``RolloutBackend`` (echoes its prompt), nothing mocked."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tasks.genrm.models import resolve_rollout
from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import BACKENDS, BackendKind, engine_key, make_backend


class EchoBackend:
    """Answers every prompt with the prompt itself (and remembers the model it was built for)."""

    def __init__(self, model: str):
        self.model = model

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return [[Completion(text=p, token_ids=[], finish_reason="stop") for _ in range(params.n)] for p in prompts]

    def format_chat(self, messages: list[dict[str, str]]) -> str:
        return "\n".join(m["content"] for m in messages)


@pytest.fixture
def echo(monkeypatch):
    kind = BackendKind("echo", lambda cfg: EchoBackend(cfg.model), settings="local", loads_model=True, device="npu:0")
    monkeypatch.setitem(BACKENDS, "echo", kind)
    return kind


def test_a_registered_backend_is_configured_built_and_shared_by_its_registration(echo, tmp_path):
    from flows.pipeline import accelerators_in

    cfg = RolloutConfig(backend="echo", model="judge-model", max_tokens=8, repetition_window=None)
    backend = make_backend(cfg)
    assert backend.generate(["2+2?"], SamplingParams(n=2, max_tokens=8))[0][1].text == "2+2?"
    # sampling settings are per call: two rollouts differing only there share one engine
    assert engine_key(cfg) == engine_key(cfg.model_copy(update={"temperature": 0.2, "n": 3}))
    assert engine_key(cfg) != engine_key(cfg.model_copy(update={"model": "other"}))
    # it loads its model itself, so home aliases resolve for it (a stage name becomes that stage's model)
    assert resolve_rollout(cfg.model_copy(update={"model": "tiny-llama"}), tmp_path).model != "tiny-llama"
    assert accelerators_in({"judge": {"rollout": {"backend": "echo"}}}) == {"npu:0"}


def test_a_backend_that_names_its_model_server_side_is_left_unresolved(monkeypatch, tmp_path):
    monkeypatch.setitem(BACKENDS, "remote", BackendKind("remote", lambda cfg: EchoBackend(cfg.model), "openai",
                                                        loads_model=False))
    cfg = RolloutConfig(backend="remote", model="tiny-llama", max_tokens=8, repetition_window=None)
    assert resolve_rollout(cfg, tmp_path) is cfg
    from flows.pipeline import accelerators_in
    assert accelerators_in({"rollout": {"backend": "remote"}}) == set()


def test_an_unregistered_backend_is_refused_naming_the_registered_ones():
    with pytest.raises(ValidationError, match=r"unknown rollout backend 'sglang'.*\['local', 'openai', 'vllm'\]"):
        RolloutConfig(backend="sglang")
