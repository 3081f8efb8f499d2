"""Who samples the RL stage's rollouts, and how the sampler gets the trainer's weights.

``InProcessSampler`` samples with the training module itself: every sample comes from the
current weights (staleness 0), nothing to sync. ``ServedSampler`` runs a separate
``posttrain serve-model`` process (the rollout engine, as vLLM/SGLang engines sit beside the
trainer ranks in verl or OpenRLHF). At the start of every step whose weights moved, the ranks
push them (gathered under ZeRO-3) as one safetensors blob of the state dict, no checkpoint:
``weight_sync: shm`` (default) puts it in shared memory (a file in ``/dev/shm``, RAM) and the
engine reads it from there (falling back to ``stream`` where ``/dev/shm`` is missing or too
small); ``stream`` posts it in the request body to /v1/weights/stream; ``disk`` writes a
Hugging Face directory under the stage. The engine stores a push and puts it in force between
batches, so a push never waits for sampling in progress.

Asynchronous rollouts: with ``batches_ahead`` d > 0 (``max_staleness`` allows it), rank 0 asks
the engine for the batch of step t + d as soon as step t's own sampling is done, pinned to the
weights of step t, and the ranks train step t while the engine samples it. Requests reach the
engine one at a time in issue order (a request thread), so which version samples which batch
never depends on timing: the run is as reproducible as a synchronous one. With
``partial_rollout_tokens`` C, a batch sampled ahead goes on past token C only under the next
version pushed (the generation waits there for it): long generations continue across the
update instead of holding the trainer back, and every token's version is known (first, last
and the boundary). A checkpoint first waits for the batches in flight and saves them with
the engine-free state, so a resumed stage trains on exactly the rollouts an uninterrupted one
would. A dead engine is restarted (``restarts`` times per stage) and given back every version
an unfinished request needs (rank 0 keeps those snapshots), then the requests are sent again.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import LocalConfig, OpenAIConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.openai_client import OpenAIBackend, OpenAIBackendError
from tasks.rollout.server import ServerProcess
from tasks.train import checkpoint, proc
from tasks.train.config import RolloutEngineConfig
from tasks.train.engine import barrier

log = logging.getLogger("posttrain.train.rollout_engine")

class InProcessSampler:
    """Samples with the engine's own module (ZeRO <= 2 keeps full weights on every rank)."""

    name = "inprocess"

    def __init__(self, engine, tokenizer, batch_size: int):
        self.engine = engine
        self.backend = LocalBackend(engine.module, tokenizer, LocalConfig(batch_size=batch_size))
        self.syncs, self.sync_seconds = 0, 0.0

    ahead = 0

    @property
    def trainer_version(self) -> int:
        return int(self.engine.global_steps)

    def prepare(self) -> None:
        """Nothing to push: the sampler holds the trained module itself."""

    def metrics(self) -> dict[str, float]:
        return {}

    def generate(self, step: int, round_: int, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        groups = self.backend.generate(prompts, params)
        self.backend.model.train()   # the sampler switched the shared module to eval
        for group in groups:
            for c in group:
                c.policy_version = self.trainer_version
        return groups

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Request:
    """One sampling round sent to the engine: ``pin`` the version it begins with, ``switch_at``
    the token from which the next version pushed takes over (partial rollouts)."""
    step: int
    round_: int
    prompts: list[str]
    params: SamplingParams
    pin: int
    switch_at: int | None = None
    then: Callable[[list[list[Completion]]], None] | None = field(default=None, repr=False)
    future: Future | None = field(default=None, repr=False)

    @property
    def extra(self) -> dict:
        body = {"policy_version": self.pin}
        if self.switch_at is not None:
            body["continue_at"] = self.switch_at
        return body


class ServedSampler:
    """A ``serve-model`` engine process fed the trainer's weights (rank 0 talks to it)."""

    name = "serve-model"

    def __init__(self, engine, tokenizer, cfg: RolloutEngineConfig, init_model: str, stage_path: Path,
                 zero_stage: int, is_rank0: bool, ahead: int = 0):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.init_model, self.zero_stage, self.is_rank0 = init_model, zero_stage, is_rank0
        self.ahead = ahead
        self.partial_at = cfg.partial_rollout_tokens if ahead else None
        self.weights_dir = stage_path / "engine_weights"
        self.version, self.restarts = 0, 0          # the newest version pushed
        self.syncs, self.sync_seconds, self.sync_bytes, self.wait_seconds = 0, 0.0, 0, 0.0
        self.snapshots: dict[int, bytes | Path] = {}   # pushed versions an unfinished request may need again
        self.requests: dict[tuple[int, int], _Request] = {}   # (step, round) -> request, in issue order
        self.ready: dict[int, list[list[Completion]]] = {}   # batches restored from a checkpoint
        self.server: ServerProcess | None = None
        self.client: OpenAIBackend | None = None
        self._warned_shm = False
        # where shared-memory snapshots go (looked up once: it clears dead trainers' directories)
        self.shm_root = shared_weights_dir() if is_rank0 and cfg.weight_sync == "shm" else None
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-requests") if is_rank0 else None
        if is_rank0:
            self._start()
        if self.trainer_version > 0:   # a resumed stage: the engine gets the checkpoint's weights
            self.push()

    @property
    def trainer_version(self) -> int:
        return int(self.engine.global_steps)

    # -- the engine process ---------------------------------------------------------------
    def _start(self) -> None:
        self.server = ServerProcess(self.init_model, threads=self.cfg.threads, batch_size=self.cfg.batch_size,
                                    startup_timeout_s=self.cfg.startup_timeout_s, device=self.cfg.device,
                                    dtype=self.cfg.dtype)
        self.client = OpenAIBackend(OpenAIConfig(
            base_url=self.server.base_url, concurrency=self.cfg.concurrency,
            prompts_per_request=self.cfg.prompts_per_request, timeout_s=self.cfg.startup_timeout_s, max_retries=1))
        self._describe(0)

    def _describe(self, in_force: int) -> None:
        """``engine.json`` in the stage directory: where the engine runs and what it was sent."""
        info = {"pid": self.server.proc.pid, "base_url": self.server.base_url, "policy_version": in_force,
                "restarts": self.restarts, "batches_ahead": self.ahead, "weight_sync": self.cfg.weight_sync}
        (self.weights_dir.parent / "engine.json").write_text(json.dumps(info, indent=2))

    def _died(self, grace_s: float = 10.0) -> bool:
        """Whether the engine process has exited, waiting ``grace_s`` for an exit in progress (a
        SIGKILLed engine closes its socket before ``poll`` sees it gone)."""
        try:
            self.server.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _recover(self) -> None:
        """The engine died: start a new one, send it every version an unfinished request needs
        (and the newest), then send those requests again, in their order (rank 0 only)."""
        code = self.server.proc.poll()
        if self.restarts >= self.cfg.restarts:
            raise RuntimeError(f"the rollout engine exited with code {code} and {self.restarts} restart(s) "
                               f"are used up (rl.rollout_engine.restarts); resume the stage to continue")
        self.restarts += 1
        self._stop_engine()
        self._start()
        for version in sorted(self.snapshots):
            self._post(version)
        for request in self.requests.values():
            if not _succeeded(request.future):
                request.future = self._sender.submit(self._call, request)
        self._describe(self.version)

    # -- weights --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Every rank, before a step samples or a checkpoint saves the batches in flight: push the
        weights if they moved since the last push (a collective under ZeRO-3)."""
        if self.trainer_version != self.version:
            self.push()

    def push(self) -> None:
        """Send the current weights to the engine (every rank calls it; rank 0 sends)."""
        started = time.monotonic()
        version = self.trainer_version
        if self.cfg.weight_sync == "disk":
            target = self.weights_dir / f"v{version:08d}"
            checkpoint.save_hf(self.engine, self.tokenizer, target, self.zero_stage, self.is_rank0)
            snapshot = target
        else:
            snapshot = checkpoint.state_dict_bytes(self.engine, self.zero_stage, self.is_rank0)
            if self.is_rank0 and self.cfg.weight_sync == "shm":
                snapshot = self._in_shared_memory(version, snapshot)
        if self.is_rank0:
            self.snapshots[version] = snapshot
            try:
                self._post(version)
            except httpx.TransportError:
                if not self._died():   # alive: the request itself failed
                    raise
                self.version = version
                self._recover()
        barrier()
        self.version = version
        if self.is_rank0:
            self._forget_snapshots()
            self._describe(version)
        self.syncs += 1
        self.sync_seconds += time.monotonic() - started

    def _in_shared_memory(self, version: int, blob: bytes) -> bytes | Path:
        """``blob`` as ``model.safetensors`` in a directory of this process under ``/dev/shm`` (the
        engine maps it from RAM); the blob itself, to stream, where there is no room."""
        root = self.shm_root
        if root is None or shutil.disk_usage(root.parent).free < 2 * len(blob):
            if not self._warned_shm:
                log.warning("rollout engine weights: /dev/shm is missing or smaller than twice the model (%d MiB); "
                            "streaming them in the request body instead (slower)", len(blob) >> 20)
                self._warned_shm = True
            return blob
        target = root / f"v{version:08d}"
        target.mkdir(parents=True, exist_ok=True)
        (target / "model.safetensors").write_bytes(blob)
        return target

    def _post(self, version: int) -> None:
        snapshot = self.snapshots[version]
        base = self.server.base_url
        if isinstance(snapshot, Path):
            response = httpx.post(f"{base}/weights", json={"path": str(snapshot), "version": version},
                                  timeout=self.cfg.startup_timeout_s)
        else:
            response = httpx.post(f"{base}/weights/stream", params={"version": version}, content=snapshot,
                                  timeout=self.cfg.startup_timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"rollout engine refused weights v{version}: {response.text[:500]}")
        self.sync_bytes = int(response.json()["bytes"])

    def _forget_snapshots(self) -> None:
        """Keep the snapshots from the oldest version an unfinished request begins with on (the
        versions after it are the ones its partial rollouts may continue under)."""
        pending = [r.pin for r in self.requests.values() if not _succeeded(r.future)]
        oldest = min([*pending, self.version])
        for version in [v for v in self.snapshots if v < oldest]:
            snapshot = self.snapshots.pop(version)
            if isinstance(snapshot, Path):
                shutil.rmtree(snapshot, ignore_errors=True)

    # -- sampling -------------------------------------------------------------------------
    def generate(self, step: int, round_: int, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """Rank 0: the groups of ``step``'s sampling round: the batch sampled ahead for its first
        round, else sampled now with the weights last pushed."""
        if not self.is_rank0:
            raise RuntimeError("only rank 0 samples from the rollout engine")
        if round_ == 0 and step in self.ready:
            return self.ready.pop(step)
        if (step, round_) not in self.requests:
            self._issue(_Request(step, round_, prompts, params, self.version))
        return self._take((step, round_), prompts)

    def sample_ahead(self, step: int, prompts: list[str], params: SamplingParams,
                     then: Callable[[list[list[Completion]]], None] | None = None) -> None:
        """Rank 0: have the engine sample ``step``'s first round now, with the weights last
        pushed (and, for partial rollouts, the next ones from ``partial_rollout_tokens`` on);
        ``then`` runs on the groups in the request thread once they are in (the rewards' verifiers)."""
        if (step, 0) not in self.requests and step not in self.ready:
            self._issue(_Request(step, 0, prompts, params, self.version, self.partial_at, then))

    def _issue(self, request: _Request) -> None:
        request.future = self._sender.submit(self._call, request)
        self.requests[(request.step, request.round_)] = request

    def _call(self, request: _Request) -> list[list[Completion]]:
        groups = self.client.generate(request.prompts, request.params, extra=request.extra,
                                      one_request=request.switch_at is not None)
        wrong = {c.policy_version for g in groups for c in g} - {request.pin}
        if wrong:
            raise RuntimeError(f"rollout engine sampled with weights v{sorted(wrong)}, expected v{request.pin}")
        if request.then is not None:
            request.then(groups)
        return groups

    def _take(self, key: tuple[int, int], prompts: list[str] | None = None) -> list[list[Completion]]:
        request = self.requests[key]
        if prompts is not None and prompts != request.prompts:
            raise RuntimeError(f"step {key[0]} round {key[1]}: the batch sampled ahead has other prompts than "
                               f"the step draws (the curriculum must be a function of the step)")
        started = time.monotonic()
        try:
            groups = request.future.result()
        except (OpenAIBackendError, httpx.TransportError):
            if not self._died():   # alive: not a crash, the request itself failed
                raise
            self._recover()
            groups = request.future.result()
        finally:
            self.wait_seconds += time.monotonic() - started
        del self.requests[key]
        return groups

    def metrics(self) -> dict[str, float]:
        return {"engine_sync_bytes": float(self.sync_bytes), "engine_wait_seconds": self.wait_seconds,
                "batches_in_flight": float(len(self.requests))}

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Rank 0, after ``prepare``: the batches sampled ahead, waited for (a checkpoint keeps
        them, since the weights that began them are gone once it resumes)."""
        if not self.is_rank0:
            return {}
        ahead = sorted(step for step, round_ in self.requests if round_ == 0)
        batches = {**self.ready, **{step: self._take((step, 0)) for step in ahead}}
        self.ready = dict(batches)
        return {"batches": {str(step): [[asdict(c) for c in g] for g in groups]
                            for step, groups in sorted(batches.items())}}

    def load_state_dict(self, state: dict) -> None:
        self.ready = {int(step): [[Completion(**c) for c in g] for g in groups]
                      for step, groups in (state or {}).get("batches", {}).items()}

    def _stop_engine(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
        self._stop_engine()
        if self.shm_root is not None:
            shutil.rmtree(self.shm_root, ignore_errors=True)


SHM = Path("/dev/shm")
SHM_PREFIX = "posttrain-weights-"


def shared_weights_dir() -> Path | None:
    """This process's directory for weight snapshots in shared memory (None without /dev/shm).
    Directories of processes that are gone (a trainer killed with SIGKILL) are removed."""
    if not SHM.is_dir():
        return None
    for stale in SHM.glob(f"{SHM_PREFIX}*"):
        pid = stale.name.removeprefix(SHM_PREFIX)
        if pid.isdigit() and int(pid) != os.getpid() and not proc.process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return SHM / f"{SHM_PREFIX}{os.getpid()}"


def _succeeded(future: Future | None) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


def make_sampler(h, engine, tokenizer):
    """The sampler the stage's ``rollout_engine`` setting names."""
    cfg = h.stage_cfg
    if cfg.rollout_engine.kind == "inprocess":
        return InProcessSampler(engine, tokenizer, cfg.prompts_per_step * cfg.group_size)
    return ServedSampler(engine, tokenizer, cfg.rollout_engine, h.job.init_model, h.path, h.cfg.engine.zero_stage,
                         h.is_rank0, ahead=cfg.batches_ahead)
