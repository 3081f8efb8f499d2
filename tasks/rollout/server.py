"""OpenAI-compatible completions server over the local backend (``posttrain serve-model``).

Endpoints: POST /v1/completions, GET /v1/models, GET /health, and POST /v1/weights (load
new weights: an RL trainer's push); bound to 127.0.0.1 by default. Concurrent requests with
the same sampling settings are merged into one batch by a single worker thread: the model
sees one large batch instead of many small ones, which is where the local sampler gets its
throughput. The same thread swaps weights between batches, so no batch mixes two versions.

Each choice carries the OpenAI ``logprobs`` object (``tokens``, ``token_logprobs``) and,
as an extension vLLM also offers, the sampled ``token_ids``; each response carries the
``policy_version`` of the weights that sampled it (the version the last push named, 0 at
start).
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
from pydantic import BaseModel, Field

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend

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
    params: SamplingParams | None          # None: a weight swap (``weights``, ``version``)
    future: Future = field(default_factory=Future)
    weights: str | None = None
    version: int = 0


class WeightsRequest(BaseModel):
    path: str = Field(description="a Hugging Face model directory with the new weights")
    version: int = Field(ge=0, description="policy version of those weights (the trainer's optimizer steps)")


class BatchingWorker:
    """One thread owns the model; it drains the queue and batches compatible jobs."""

    def __init__(self, backend: LocalBackend, max_batch_prompts: int = MAX_BATCH_PROMPTS):
        self.backend = backend
        self.max_batch_prompts = max_batch_prompts
        self.version = 0
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompts: list[str], params: SamplingParams) -> Future:
        """Completions for ``prompts``; the future's result is (completions, policy version)."""
        job = _Job(prompts, params)
        self.jobs.put(job)
        return job.future

    def swap_weights(self, path: str, version: int) -> Future:
        """Load the model in ``path`` between batches; the future's result is the load time."""
        job = _Job([], None, weights=path, version=version)
        self.jobs.put(job)
        return job.future

    def _take_batch(self) -> list[_Job]:
        first = self.jobs.get()
        batch, size, deferred = [first], len(first.prompts), []
        while first.params is not None and size < self.max_batch_prompts:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job.params == first.params:
                batch.append(job)
                size += len(job.prompts)
            else:
                deferred.append(job)
        for job in deferred:
            self.jobs.put(job)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch[0].params is None:
                self._swap(batch[0])
                continue
            prompts = [p for job in batch for p in job.prompts]
            try:
                results = self.backend.generate(prompts, batch[0].params)
            except Exception as e:  # noqa: BLE001 - reported to every waiting request
                for job in batch:
                    job.future.set_exception(e)
                continue
            offset = 0
            for job in batch:
                job.future.set_result((results[offset:offset + len(job.prompts)], self.version))
                offset += len(job.prompts)

    def _swap(self, job: _Job) -> None:
        from safetensors.torch import load_file

        started = time.monotonic()
        try:
            state: dict = {}
            for shard in sorted(Path(job.weights).glob("*.safetensors")):
                state.update(load_file(str(shard)))
            if not state:
                raise FileNotFoundError(f"no *.safetensors in {job.weights}")
            # a tied weight is saved once: strict=False, but every saved tensor must land and
            # every missing one must share storage with one that did
            model = self.backend.model
            missing, unexpected = model.load_state_dict(state, strict=False)
            tensors = dict(model.state_dict(keep_vars=True))
            loaded = {tensors[k].data_ptr() for k in state if k in tensors}
            untied = [k for k in missing if tensors[k].data_ptr() not in loaded]
            if unexpected or untied:
                raise ValueError(f"weights in {job.weights} do not fit the served model: unexpected "
                                 f"{unexpected[:5]}, missing {untied[:5]}")
            self.version = job.version
            job.future.set_result(time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 - the pusher gets the reason; serving goes on
            job.future.set_exception(e)


def _choice(index: int, completion: Completion, tokenizer, want_logprobs: bool) -> dict:
    choice = {"index": index, "text": completion.text, "finish_reason": completion.finish_reason,
              "token_ids": completion.token_ids, "logprobs": None}
    if want_logprobs and completion.logprobs is not None:
        choice["logprobs"] = {
            "tokens": [tokenizer.decode([t]) for t in completion.token_ids],
            "token_logprobs": completion.logprobs,
        }
    return choice


def create_app(backend: LocalBackend, model_name: str):
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="posttrain serve-model")
    worker = BatchingWorker(backend)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name, "policy_version": worker.version}

    @app.post("/v1/weights")
    def weights(request: WeightsRequest) -> dict:
        try:
            seconds = worker.swap_weights(request.path, request.version).result()
        except (OSError, ValueError, RuntimeError) as e:
            raise HTTPException(400, f"could not load weights from {request.path}: {e}") from None
        return {"policy_version": worker.version, "seconds": seconds}

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
        results, version = worker.submit(prompts, request.sampling_params()).result()
        choices, tokens = [], 0
        for per_prompt in results:
            for completion in per_prompt:
                choices.append(_choice(len(choices), completion, backend.tokenizer, request.logprobs is not None))
                tokens += len(completion.token_ids)
        return {
            "id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "policy_version": version,
            "usage": {"completion_tokens": tokens},
        }

    return app


def serve_model(
    model_path: str | Path, host: str = "127.0.0.1", port: int = 8000,
    config: LocalConfig | None = None, model_name: str | None = None,
) -> None:
    """Serve ``model_path`` until interrupted (blocking)."""
    import uvicorn

    from tasks.rollout.factory import resolve_model

    path = resolve_model(str(model_path))
    backend = LocalBackend.from_path(path, config)
    app = create_app(backend, model_name or Path(path).name)
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
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_with(args.parent_pid)
    serve_model(args.model, args.host, args.port, LocalConfig(threads=args.threads, batch_size=args.batch_size,
                                                              device=args.device, dtype=args.dtype))


def _exit_with(parent_pid: int, poll_s: float = 1.0) -> None:
    """A daemon thread that ends this process once ``parent_pid`` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    main()
