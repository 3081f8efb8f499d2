"""OpenAI-compatible completions server over the local backend (``posttrain serve-model``).

Endpoints: POST /v1/completions, GET /v1/models, GET /health, and two for an RL trainer's
weight push: POST /v1/weights/stream?version=N (the state dict as one safetensors blob in the
body: no file anywhere) and POST /v1/weights (a Hugging Face directory: the disk fallback).
Bound to 127.0.0.1 by default. Concurrent requests with the same sampling settings are merged
into one batch by a single worker thread: the model sees one large batch instead of many small
ones, which is where the local sampler gets its throughput.

A push only stores the weights (``WeightStore``); the worker puts a version in force between
batches, so a trainer pushing never waits for the batch in progress. A request may name the
version to sample with (``policy_version``, waiting for its push) and, for a partial rollout,
the token ``continue_at`` from which the next version pushed after it takes over (the
generation waits there for that push and goes on under it).

Each choice carries the OpenAI ``logprobs`` object (``tokens``, ``token_logprobs``) and,
as extensions, the sampled ``token_ids`` (vLLM offers it too), ``policy_versions`` (the versions
of its first and last token) and ``version_boundary`` (the first token of the later version, or
null); each response carries the ``policy_version`` of the weights that began it (0 at start).
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
import torch
from pydantic import BaseModel, Field, model_validator
from starlette.requests import Request

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend, WeightSwitch

MAX_BATCH_PROMPTS = 64


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str | list[str]
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(16, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0)
    repetition_window: int | None = Field(None, ge=1, description="extension: M1 truncation window")
    repetition_prob: float = Field(0.99, gt=0, lt=1)
    policy_version: int | None = Field(None, ge=0, description="extension: sample with exactly these weights "
                                                               "(waiting for their push)")
    continue_at: int | None = Field(None, ge=1, description="extension (partial rollouts): from this token on, "
                                                            "sample with the next version pushed after policy_version")

    @model_validator(mode="after")
    def _partial(self) -> Self:
        if self.continue_at is not None and self.policy_version is None:
            raise ValueError("continue_at needs the policy_version the generation begins with")
        return self

    def sampling_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
            stop=stop, seed=self.seed or 0, repetition_window=self.repetition_window,
            repetition_prob=self.repetition_prob, logprobs=True,
        )


@dataclass
class _Job:
    prompts: list[str]
    params: SamplingParams
    future: Future = field(default_factory=Future)
    pin: int | None = None      # sample with exactly this version (None: the newest pushed)
    switch_at: int | None = None   # a partial rollout: the next version pushed samples from this token on

    def batches_with(self, other: _Job) -> bool:
        return (self.params, self.pin, self.switch_at) == (other.params, other.pin, other.switch_at)


class WeightsRequest(BaseModel):
    path: str = Field(description="a Hugging Face model directory with the new weights")
    version: int = Field(ge=0, description="policy version of those weights (the trainer's optimizer steps)")


def read_weights_dir(path: str | Path) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``path``."""
    from safetensors.torch import load_file

    state: dict = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(shard)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return state


class WeightStore:
    """Weights pushed to the engine, by version, until the batching thread puts them in force.

    A push only stores (and checks) the tensors, so a trainer pushing while the engine samples
    never waits for the batch in progress. A job that names its version (``pin``) puts exactly
    that version in force first, waiting up to ``wait_s`` for its push; one that names none
    takes the newest pushed. Versions only move forward.
    """

    def __init__(self, model, wait_s: float):
        self.model, self.wait_s = model, wait_s
        self.version = 0
        self._pending: dict[int, dict] = {}
        self._cond = threading.Condition()

    def put(self, version: int, state: dict, source: str) -> None:
        """Store ``state`` as ``version`` (handler threads); ValueError when it does not fit."""
        self._check_fits(state, source)
        with self._cond:
            if version < self.version:
                raise ValueError(f"weights v{version} from {source} are older than v{self.version} in force")
            if version > self.version:
                self._pending[version] = state
                self._cond.notify_all()

    def _check_fits(self, state: dict, source: str) -> None:
        """A tied weight is saved once, so a tensor may be missing, but only when it shares
        storage with one that came; every tensor that came must exist with its shape."""
        tensors = dict(self.model.state_dict(keep_vars=True))
        unexpected = [k for k in state if k not in tensors]
        reshaped = [k for k in state if k in tensors and tuple(state[k].shape) != tuple(tensors[k].shape)]
        loaded = {tensors[k].data_ptr() for k in state if k in tensors}
        untied = [k for k in tensors if k not in state and tensors[k].data_ptr() not in loaded]
        if unexpected or reshaped or untied:
            raise ValueError(f"weights in {source} do not fit the served model: unexpected {unexpected[:5]}, "
                             f"other shape {reshaped[:5]}, missing {untied[:5]}")

    def enter(self, version: int | None) -> None:
        """Put ``version`` (None: the newest pushed, if any) in force (the batching thread)."""
        with self._cond:
            if version is None:
                if not self._pending:
                    return
                version = max(self._pending)
            if version < self.version:
                raise RuntimeError(f"weights v{version} were asked for, but v{self.version} is already in force")
        if version != self.version:
            self._load_when(lambda pending: version if version in pending else None, f"weights v{version}")

    def enter_next(self) -> int:
        """Put the first version pushed after the one in force in force (a partial rollout's
        later weights), waiting for its push; the version."""
        current = self.version
        return self._load_when(lambda pending: min((v for v in pending if v > current), default=None),
                               f"weights after v{current}")

    def _load_when(self, pick, what: str) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: pick(self._pending) is not None, timeout=self.wait_s):
                raise TimeoutError(f"{what} were not pushed within {self.wait_s:.0f}s "
                                   f"(pushed and waiting: {sorted(self._pending)})")
            version = pick(self._pending)
            state = self._pending.pop(version)
            for older in [v for v in self._pending if v < version]:
                del self._pending[older]
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self.version = version
        return version


class BatchingWorker:
    """One thread owns the model; it drains the queue and batches compatible jobs."""

    def __init__(self, backend: LocalBackend, max_batch_prompts: int = MAX_BATCH_PROMPTS,
                 version_wait_s: float = 600.0):
        self.backend = backend
        self.max_batch_prompts = max_batch_prompts
        self.store = WeightStore(backend.model, version_wait_s)
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
        self.thread.start()

    @property
    def version(self) -> int:
        return self.store.version

    def submit(self, prompts: list[str], params: SamplingParams, pin: int | None = None,
               switch_at: int | None = None) -> Future:
        """Completions for ``prompts``; the future's result is (completions, version that sampled
        their first tokens, (token index, later version) if the weights switched, else None)."""
        job = _Job(prompts, params, pin=pin, switch_at=switch_at)
        self.jobs.put(job)
        return job.future

    def _take_batch(self) -> list[_Job]:
        first = self.jobs.get()
        batch, size, deferred = [first], len(first.prompts), []
        while size < self.max_batch_prompts:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job.batches_with(first):
                batch.append(job)
                size += len(job.prompts)
            else:
                deferred.append(job)
        for job in deferred:
            self.jobs.put(job)
        return batch

    def _loop(self) -> None:
        while True:
            self._run(self._take_batch())

    def _run(self, batch: list[_Job]) -> None:
        first, switched = batch[0], []
        prompts = [p for job in batch for p in job.prompts]
        try:
            self.store.enter(first.pin)
            version, switch = self.store.version, None
            if first.switch_at is not None:
                switch = WeightSwitch(first.switch_at, lambda: switched.append(self.store.enter_next()))
            results = self.backend.generate(prompts, first.params, switch=switch)
        except Exception as e:  # noqa: BLE001 - reported to every waiting request
            for job in batch:
                job.future.set_exception(e)
            return
        offset = 0
        for job in batch:
            job.future.set_result((results[offset:offset + len(job.prompts)], version,
                                   (first.switch_at, switched[0]) if switched else None))
            offset += len(job.prompts)


def _choice(index: int, completion: Completion, tokenizer, want_logprobs: bool, version: int,
            switch: tuple[int, int] | None) -> dict:
    boundary = switch[0] if switch is not None and len(completion.token_ids) > switch[0] else None
    choice = {"index": index, "text": completion.text, "finish_reason": completion.finish_reason,
              "token_ids": completion.token_ids, "logprobs": None,
              "policy_versions": [version, switch[1] if boundary is not None else version],
              "version_boundary": boundary}
    if want_logprobs and completion.logprobs is not None:
        choice["logprobs"] = {
            "tokens": [tokenizer.decode([t]) for t in completion.token_ids],
            "token_logprobs": completion.logprobs,
        }
    return choice


def create_app(backend: LocalBackend, model_name: str, version_wait_s: float = 600.0):
    from fastapi import FastAPI, HTTPException
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    app = FastAPI(title="posttrain serve-model")
    worker = BatchingWorker(backend, version_wait_s=version_wait_s)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name, "policy_version": worker.version}

    def store(version: int, read, source: str) -> dict:
        started = time.monotonic()
        try:
            state = read()
            worker.store.put(version, state, source)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise HTTPException(400, f"could not load weights from {source}: {e}") from None
        size = sum(t.numel() * t.element_size() for t in state.values())
        return {"policy_version": version, "in_force": worker.version, "bytes": size,
                "seconds": time.monotonic() - started}

    @app.post("/v1/weights")
    def weights(request: WeightsRequest) -> dict:
        """Weights from a Hugging Face directory (the disk fallback)."""
        return store(request.version, lambda: read_weights_dir(request.path), request.path)

    @app.post("/v1/weights/stream")
    async def weights_stream(request: Request, version: int) -> dict:
        """Weights in the request body, one safetensors blob: no file on either side."""
        body = await request.body()
        return store(version, lambda: load_safetensors(body), f"a streamed state dict (v{version})")

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "posttrain"}]}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict:
        if request.model not in (None, model_name):
            raise HTTPException(404, f"model {request.model!r} is not served here; this serves {model_name!r}")
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts:
            raise HTTPException(400, "prompt must not be empty")
        try:
            results, version, switched = worker.submit(prompts, request.sampling_params(), request.policy_version,
                                                       request.continue_at).result()
        except (TimeoutError, RuntimeError) as e:   # a version that never came, or one already passed
            raise HTTPException(409, str(e)) from None
        choices, tokens = [], 0
        for per_prompt in results:
            for completion in per_prompt:
                choices.append(_choice(len(choices), completion, backend.tokenizer, request.logprobs is not None,
                                       version, switched))
                tokens += len(completion.token_ids)
        return {
            "id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "policy_version": version,
            "usage": {"completion_tokens": tokens},
        }

    return app


def serve_model(
    model_path: str | Path, host: str = "127.0.0.1", port: int = 8000,
    config: LocalConfig | None = None, model_name: str | None = None, version_wait_s: float = 600.0,
) -> None:
    """Serve ``model_path`` until interrupted (blocking)."""
    import uvicorn

    from tasks.rollout.factory import resolve_model

    path = resolve_model(str(model_path))
    backend = LocalBackend.from_path(path, config)
    app = create_app(backend, model_name or Path(path).name, version_wait_s)
    uvicorn.run(app, host=host, port=port, log_level="warning", workers=1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``serve_model`` in a subprocess: for tests, benchmarks and local pipelines."""

    def __init__(self, model_path: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 threads: int | None = None, batch_size: int | None = None, startup_timeout_s: float = 120.0,
                 exit_with_parent: bool = True, device: str | None = None, dtype: str | None = None):
        self.host, self.port = host, port or free_port(host)
        cmd = [sys.executable, "-m", "tasks.rollout.server", "--model", str(model_path),
               "--host", host, "--port", str(self.port)]
        if exit_with_parent:   # a parent killed hard (SIGKILL) leaves no orphan server behind
            cmd += ["--parent-pid", str(os.getpid())]
        if threads:
            cmd += ["--threads", str(threads)]
        if batch_size:
            cmd += ["--batch-size", str(batch_size)]
        if device:
            cmd += ["--device", device]
        if dtype:
            cmd += ["--dtype", dtype]
        repo_root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": f"{repo_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, env=env, cwd=repo_root)
        self._wait_healthy(startup_timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve-model exited with code {self.proc.returncode} before becoming healthy")
            try:
                if httpx.get(f"http://{self.host}:{self.port}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"serve-model on port {self.port} not healthy after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a local model over the OpenAI completions API")
    parser.add_argument("--model", required=True, help="model dir, .gguf file, or alias (smol, tiny-llama)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=LocalConfig().batch_size)
    parser.add_argument("--device", default=LocalConfig().device)
    parser.add_argument("--dtype", default=LocalConfig().dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--version-wait-s", type=float, default=600.0,
                        help="how long a request naming a policy version waits for that version's push")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_with(args.parent_pid)
    serve_model(args.model, args.host, args.port, LocalConfig(threads=args.threads, batch_size=args.batch_size,
                                                              device=args.device, dtype=args.dtype),
                version_wait_s=args.version_wait_s)


def _exit_with(parent_pid: int, poll_s: float = 1.0) -> None:
    """A daemon thread that ends this process once ``parent_pid`` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    main()
