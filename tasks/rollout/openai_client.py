"""OpenAI-compatible completions client: any server speaking /v1/completions
(vLLM, SGLang, TGI, llama.cpp, ``posttrain serve-model``).

Prompts are sent in groups (``prompts_per_request`` per request, the API's list form) by
a thread pool of ``concurrency`` workers over one pooled httpx client. A group starting at
prompt i is sent with seed ``seed + i``. 5xx, 429 and connection errors/timeouts are
retried with exponential backoff; other 4xx fail at once with the server's message. The
M1 repetition rule is applied afterwards from the returned log-probs.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.chat import render_chatml, render_with_tokenizer
from tasks.rollout.config import OpenAIConfig
from tasks.rollout.repetition import truncate_on_repetition

RETRY_STATUS = {429, 500, 502, 503, 504}


class OpenAIBackendError(RuntimeError):
    pass


class OpenAIBackend:
    name = "openai"

    def __init__(self, config: OpenAIConfig | None = None):
        self.config = config or OpenAIConfig()
        headers = {}
        if self.config.api_key_env:
            key = os.environ.get(self.config.api_key_env)
            if not key:
                raise OpenAIBackendError(f"API key variable {self.config.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        limits = httpx.Limits(max_connections=self.config.concurrency,
                              max_keepalive_connections=self.config.concurrency)
        self.client = httpx.Client(base_url=self.config.base_url.rstrip("/"), headers=headers,
                                   timeout=self.config.timeout_s, limits=limits)
        self._tokenizer = None
        if self.config.tokenizer:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer)
        self.model_name = self.config.served_model or self._first_served_model()

    def close(self) -> None:
        self.client.close()

    @property
    def tokenizer(self):
        """The local tokenizer named by ``rollout.openai.tokenizer`` (None without one): what renders
        multi-turn episodes for the server (``tasks.agents``)."""
        return self._tokenizer

    # -- RolloutBackend -------------------------------------------------------------------
    def format_chat(self, messages: list[dict[str, str]]) -> str:
        if self._tokenizer is not None:
            return render_with_tokenizer(self._tokenizer, messages)
        return render_chatml(messages)

    def generate(self, prompts: list[str], params: SamplingParams, extra: dict | None = None,
                 one_request: bool = False) -> list[list[Completion]]:
        """``extra``: further body fields (a server's extensions, as the OpenAI SDK's ``extra_body``);
        ``one_request``: every prompt in a single request (a server-side schedule then spans them all)."""
        group = max(1, len(prompts)) if one_request else self.config.prompts_per_request
        starts = list(range(0, len(prompts), group))
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            parts = pool.map(lambda s: self._generate_group(prompts[s:s + group], s, params, extra), starts)
            return [per_prompt for part in parts for per_prompt in part]

    # -- internals ------------------------------------------------------------------------
    def _first_served_model(self) -> str:
        models = self._request("GET", "/models").get("data") or []
        if not models:
            raise OpenAIBackendError(f"{self.config.base_url}/models lists no model")
        return models[0]["id"]

    def _generate_group(self, prompts: list[str], first_index: int, params: SamplingParams,
                        extra: dict | None = None) -> list[list[Completion]]:
        """One request for a group of prompts; choices come back prompt-major (i * n + j)."""
        body = {
            "model": self.model_name, "prompt": prompts, "n": params.n,
            "temperature": params.temperature, "top_p": params.top_p,
            "max_tokens": params.max_tokens, "seed": params.seed + first_index,
            "logprobs": 0 if (params.logprobs or params.repetition_window) else None,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        body.update(extra or {})
        payload = self._request("POST", "/completions", json=body)
        choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != params.n * len(prompts):
            raise OpenAIBackendError(
                f"server returned {len(choices)} choices for {len(prompts)} prompt(s) x n={params.n}")
        completions = [self._completion(c, params) for c in choices]
        version = payload.get("policy_version")   # posttrain serve-model's extensions
        if version is not None:
            for choice, c in zip(choices, completions):
                c.policy_version = int(version)
                boundary = choice.get("version_boundary")
                if boundary is not None and boundary < len(c.token_ids):   # repetition may cut before it
                    c.version_boundary, c.policy_version_last = int(boundary), int(choice["policy_versions"][-1])
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _completion(self, choice: dict, params: SamplingParams) -> Completion:
        logprobs = choice.get("logprobs") or {}
        token_logprobs = logprobs.get("token_logprobs")
        token_texts = logprobs.get("tokens")
        finish = choice.get("finish_reason") or "stop"
        completion = Completion(
            text=choice.get("text", ""),
            token_ids=list(choice.get("token_ids") or []),
            # a null log-prob stays unknown (None): 0.0 would claim probability 1
            logprobs=[float(x) if x is not None else None for x in token_logprobs] if token_logprobs else None,
            finish_reason=finish if finish in ("stop", "length", "repetition") else "stop",
        )
        if params.repetition_window and completion.logprobs and token_texts:
            completion = truncate_on_repetition(
                completion, params.repetition_window, params.repetition_prob, token_texts=token_texts
            )
        if not params.logprobs:
            completion.logprobs = None
        return completion

    def _request(self, method: str, path: str, **kwargs) -> dict:
        delay, attempts = self.config.backoff_s, self.config.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.TransportError as e:  # connection refused/reset, timeouts
                failure = f"{type(e).__name__}: {e}"
            else:
                if response.status_code < 400:
                    return response.json()
                failure = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in RETRY_STATUS:
                    break
            if attempt < attempts:
                time.sleep(delay)
                delay *= 2
        raise OpenAIBackendError(f"{method} {self.config.base_url}{path} failed after {attempt} attempt(s): {failure}")
