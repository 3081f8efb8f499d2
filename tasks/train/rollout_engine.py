"""Who samples the RL stage's rollouts, and how the sampler gets the trainer's weights.

``InProcessSampler`` samples with the training module itself: every sample comes from the
current weights (staleness 0), nothing to sync. ``ServedSampler`` runs a separate
``posttrain serve-model`` process (the rollout engine, as vLLM/SGLang engines sit beside the
trainer ranks in verl or OpenRLHF): before a sampling round whose weights would lag the
trainer's by more than ``max_staleness`` optimizer steps, rank 0 writes the weights as a
Hugging Face directory (gathered under ZeRO-3) and POSTs it to the engine's /v1/weights;
the engine swaps them between batches and reports the version that sampled each response.
A dead engine is restarted with the current weights (``restarts`` times per stage); a
resumed stage starts its engine from the checkpoint's weights the same way.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import LocalConfig, OpenAIConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.openai_client import OpenAIBackend, OpenAIBackendError
from tasks.rollout.server import ServerProcess
from tasks.train import checkpoint
from tasks.train.config import RolloutEngineConfig
from tasks.train.engine import barrier


class InProcessSampler:
    """Samples with the engine's own module (ZeRO <= 2 keeps full weights on every rank)."""

    name = "inprocess"

    def __init__(self, engine, tokenizer, batch_size: int):
        self.engine = engine
        self.backend = LocalBackend(engine.module, tokenizer, LocalConfig(batch_size=batch_size))
        self.syncs, self.sync_seconds = 0, 0.0

    @property
    def trainer_version(self) -> int:
        return int(self.engine.global_steps)

    def prepare(self) -> int:
        """Staleness (optimizer steps) of the weights the next round samples with: always 0."""
        return 0

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        groups = self.backend.generate(prompts, params)
        self.backend.model.train()   # the sampler switched the shared module to eval
        for group in groups:
            for c in group:
                c.policy_version = self.trainer_version
        return groups

    def close(self) -> None:
        pass


class ServedSampler:
    """A ``serve-model`` engine process fed the trainer's weights (rank 0 talks to it)."""

    name = "serve-model"

    def __init__(self, engine, tokenizer, cfg: RolloutEngineConfig, init_model: str, stage_path: Path,
                 zero_stage: int, is_rank0: bool):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.init_model, self.zero_stage, self.is_rank0 = init_model, zero_stage, is_rank0
        self.weights_dir = stage_path / "engine_weights"
        self.version, self.syncs, self.sync_seconds, self.restarts = 0, 0, 0.0, 0
        self.server: ServerProcess | None = None
        self.client: OpenAIBackend | None = None
        if is_rank0:
            self._start()
        if self.trainer_version > 0:   # a resumed stage: the engine gets the checkpoint's weights
            self.push()

    @property
    def trainer_version(self) -> int:
        return int(self.engine.global_steps)

    def _start(self) -> None:
        self.server = ServerProcess(self.init_model, threads=self.cfg.threads, batch_size=self.cfg.batch_size,
                                    startup_timeout_s=self.cfg.startup_timeout_s, device=self.cfg.device,
                                    dtype=self.cfg.dtype)
        self.client = OpenAIBackend(OpenAIConfig(
            base_url=self.server.base_url, concurrency=self.cfg.concurrency,
            prompts_per_request=self.cfg.prompts_per_request, timeout_s=self.cfg.startup_timeout_s, max_retries=1))
        self.version = 0   # a fresh engine holds the stage's initial weights
        self._describe()

    def _describe(self) -> None:
        """``engine.json`` in the stage directory: where the engine runs and what it holds."""
        info = {"pid": self.server.proc.pid, "base_url": self.server.base_url, "policy_version": self.version,
                "restarts": self.restarts}
        (self.weights_dir.parent / "engine.json").write_text(json.dumps(info, indent=2))

    def push(self) -> None:
        """Write the current weights (a collective under ZeRO-3) and load them into the engine."""
        started = time.monotonic()
        version = self.trainer_version
        target = self.weights_dir / f"v{version:08d}"
        checkpoint.save_hf(self.engine, self.tokenizer, target, self.zero_stage, self.is_rank0)
        if self.is_rank0:
            self._ensure_running()
            self._load(target, version)
            for old in sorted(self.weights_dir.glob("v*")):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
        barrier()
        self.version = version
        if self.is_rank0:
            self._describe()
        self.syncs += 1
        self.sync_seconds += time.monotonic() - started

    def _load(self, target: Path, version: int) -> None:
        """Have the engine load the weights in ``target`` as ``version``; an engine that died
        (its port refusing before its exit is visible) is restarted first, within ``restarts``."""
        try:
            self._post_weights(target, version)
        except httpx.TransportError:
            if not self._died():   # alive: the request itself failed
                raise
            self._ensure_running()
            self._post_weights(target, version)

    def _died(self, grace_s: float = 10.0) -> bool:
        """Whether the engine process has exited, waiting ``grace_s`` for an exit in progress (a
        SIGKILLed engine closes its socket before ``poll`` sees it gone)."""
        try:
            self.server.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _post_weights(self, target: Path, version: int) -> None:
        response = httpx.post(f"{self.server.base_url}/weights", json={"path": str(target), "version": version},
                              timeout=self.cfg.startup_timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"rollout engine refused weights v{version}: {response.text[:500]}")

    def prepare(self) -> int:
        """Push first if the engine lags by more than ``max_staleness``; the staleness it samples with."""
        if self.trainer_version - self.version > self.cfg.max_staleness:
            self.push()
        return self.trainer_version - self.version

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        if not self.is_rank0:
            raise RuntimeError("only rank 0 samples from the rollout engine")
        self._ensure_running()
        try:
            groups = self.client.generate(prompts, params)
        except OpenAIBackendError:
            if not self._died():   # alive: not a crash, the request itself failed
                raise
            self._ensure_running()
            groups = self.client.generate(prompts, params)
        stale = {c.policy_version for g in groups for c in g} - {self.version}
        if stale:
            raise RuntimeError(f"rollout engine sampled with weights v{sorted(stale)}, expected v{self.version}")
        return groups

    def _ensure_running(self) -> None:
        """Restart a dead engine (up to ``restarts`` times in the stage)."""
        code = self.server.proc.poll()
        if code is None:
            return
        if self.restarts >= self.cfg.restarts:
            raise RuntimeError(f"the rollout engine exited with code {code} and {self.restarts} restart(s) "
                               f"are used up (rl.rollout_engine.restarts); resume the stage to continue")
        self._restart()

    def _restart(self) -> None:
        """The engine died: start a new one with the weights it last had (rank 0 only; the
        directory of the last push is kept for this)."""
        self.restarts += 1
        pushed = self.version
        self.close()
        self._start()
        if pushed > 0:
            target = self.weights_dir / f"v{pushed:08d}"
            self._load(target, pushed)
            self.version = pushed
        self._describe()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()


def make_sampler(h, engine, tokenizer):
    """The sampler the stage's ``rollout_engine`` setting names."""
    cfg = h.stage_cfg
    if cfg.rollout_engine.kind == "inprocess":
        return InProcessSampler(engine, tokenizer, cfg.prompts_per_step * cfg.group_size)
    return ServedSampler(engine, tokenizer, cfg.rollout_engine, h.job.init_model, h.path, h.cfg.engine.zero_stage,
                         h.is_rank0)
