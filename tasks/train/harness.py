"""What every stage shares: the job description and the harness a recipe trains with.

A ``StageJob`` is plain JSON, so the same stage code runs in this process (one rank) or
in launcher-started ranks (``launcher_entry.py --job job.json``). The ``StageHarness``
gives a recipe (``tasks.train.sft`` / ``dpo`` / ``rl``) its policy, data, engine, resume
and logging; rank 0 writes the step log, MLflow metrics, plots and the final model.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from tasks import tracking
from tasks.train import checkpoint
from tasks.train.config import TrainConfig
from tasks.train.engine import barrier, create_engine, rank, world_size
from warehouse import TableRef, Warehouse


def ids_digest(example_ids: list[str]) -> str:
    """Short digest of the examples a step saw, to check the data order after a resume."""
    return hashlib.sha256("|".join(example_ids).encode()).hexdigest()[:16]


@dataclass
class StageJob:
    stage: str
    home: str
    run_name: str
    profile: str
    init_model: str
    data_ref: TableRef                 # the training-table snapshot the stage trains on
    config: dict                       # TrainConfig.model_dump()
    fingerprint: str                   # hash of config + inputs; a mismatch forbids resuming
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # job.json holds the reference as a dict (older files: "<table>@<snapshot>")
        if isinstance(self.data_ref, str):
            self.data_ref = TableRef.parse(self.data_ref)
        elif isinstance(self.data_ref, dict):
            self.data_ref = TableRef(**self.data_ref)

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig(**self.config)

    @property
    def stage_path(self) -> Path:
        return checkpoint.stage_dir(Warehouse(self.home).checkpoints_dir, self.run_name, self.stage)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2, default=str))

    @classmethod
    def load(cls, path: Path) -> StageJob:
        return cls(**json.loads(Path(path).read_text()))


class StageHarness:
    """One stage's shared machinery, for the rank running it."""

    def __init__(self, job: StageJob):
        self.job = job
        self.cfg = job.train_config
        self.stage_cfg = self.cfg.stage(job.stage)
        self.path = job.stage_path
        self.path.mkdir(parents=True, exist_ok=True)
        self.is_rank0 = rank() == 0
        self.steps = checkpoint.StepLog(self.path, enabled=self.is_rank0)
        self.history: list[dict] = []
        self.partitioned = False   # set by load_policy
        self.started = time.time()
        if job.tracking_uri:   # the job names its store: launcher-started ranks log where the flow does
            tracking.configure(job.tracking_uri)

    # -- inputs -------------------------------------------------------------------------
    def load_policy(self):
        """(policy, tokenizer). Under ZeRO-3 the policy comes partitioned across the ranks (each
        builds and keeps only its share of every parameter), ready for ``create_engine``; else
        whole, in FP32."""
        from model.loading import load_causal_lm

        zero3_config = self._partitioned_load_config()
        model, tokenizer = load_causal_lm(self.job.init_model, dtype="float32", zero3_config=zero3_config)
        # a partitioned policy runs only inside its engine (whose hooks gather each module's
        # parameters for its forward): a recipe that scores with the policy before training
        # (DPO's reference) asks this and builds the engine first
        self.partitioned = zero3_config is not None
        return model.train(), tokenizer

    def _partitioned_load_config(self) -> dict | None:
        """The DeepSpeed config ``create_engine`` will build for this stage when it is ZeRO-3
        (the same generator, the same global batch; clipping does not matter to ``zero.Init``),
        with the process group it needs set up; None for a whole-model load."""
        from tasks.train.engine import MMAP_THRESHOLD_ENV, engine_setup

        engine = self.cfg.engine
        if engine.zero_stage != 3:
            return None
        ds_config = engine_setup(engine)
        import deepspeed

        deepspeed.init_distributed()   # before zero.Init reads the config: it checks the batch against the world
        if self.is_rank0:
            print(f"posttrain: {self.job.stage} loads {self.job.init_model} partitioned across "
                  f"{world_size()} rank(s) (ZeRO-3; glibc mmap threshold: "
                  f"{os.environ.get(MMAP_THRESHOLD_ENV, 'dynamic')})", file=sys.stderr, flush=True)
        return ds_config

    def read_data(self) -> pl.DataFrame:
        ref = self.job.data_ref
        df = Warehouse(self.job.home).read(ref.name, ref.snapshot)
        if "stage" in df.columns:
            df = df.filter(pl.col("stage") == self.job.stage)
        if df.is_empty():
            raise ValueError(f"stage {self.job.stage}: no rows in {self.job.data_ref}")
        return df

    # -- engine and resume ----------------------------------------------------------------
    def create_engine(self, model, gradient_clipping: float | None = None):
        engine, ds_config = create_engine(model, self.cfg.engine, self.cfg.optimizer,
                                          self.cfg.stage_lr(self.job.stage), self.stage_cfg.steps,
                                          gradient_clipping)
        if self.is_rank0:
            (self.path / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
            if self.job.mlflow_run_id:
                tracking.log_dict(ds_config, f"{self.job.stage}/ds_config.json", run_id=self.job.mlflow_run_id)
        return engine

    def resume(self, engine) -> tuple[int, dict]:
        """(first step to run, client state) after loading the latest checkpoint, if any."""
        state = checkpoint.load(engine, self.path)
        if state is None:
            if self.is_rank0:
                self.steps.truncate_after(-1)
            return 0, {}
        step = int(state["step"])
        self.history = self.steps.truncate_after(step - 1) if self.is_rank0 else []
        if self.is_rank0:
            print(f"posttrain: {self.job.stage} resumes from its checkpoint at step {step} of "
                  f"{self.stage_cfg.steps} ({self.path})", file=sys.stderr, flush=True)
        return step, state

    def global_batch(self) -> int:
        e = self.cfg.engine
        return e.micro_batch_size * e.gradient_accumulation_steps * world_size()

    def rank_micro_batches(self, indices: list[int]) -> list[list[int]]:
        """This rank's share of a step's examples, split into accumulation micro-batches."""
        mine = indices[rank()::world_size()]
        size = self.cfg.engine.micro_batch_size
        return [mine[i:i + size] for i in range(0, len(mine), size)]

    # -- per step -------------------------------------------------------------------------
    def record(self, step: int, metrics: dict[str, float], **extra) -> None:
        """Rank 0: the step log line and the MLflow metrics (``<stage>.<name>``)."""
        if not self.is_rank0:
            return
        rec = {"step": step, **{k: float(v) for k, v in metrics.items()}, **extra}
        self.steps.append(rec)
        self.history.append(rec)
        if self.job.mlflow_run_id and (step % self.stage_cfg.log_every == 0 or step + 1 == self.stage_cfg.steps):
            tracking.log_counters(metrics, prefix=self.job.stage, step=step, run_id=self.job.mlflow_run_id)

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint follows ``step`` (0-based): (step + 1) is a multiple of
        checkpoint_every, short of the last step (the final model is saved instead)."""
        done = step + 1
        return done % self.stage_cfg.checkpoint_every == 0 and done < self.stage_cfg.steps

    def maybe_checkpoint(self, engine, step: int, client_state: dict | None = None) -> None:
        """After ``step`` (0-based) completed: save when ``checkpoint_due``."""
        if self.checkpoint_due(step):
            checkpoint.save(engine, self.path, step + 1, client_state or {}, self.stage_cfg.keep_checkpoints,
                            self.is_rank0)

    # -- the end --------------------------------------------------------------------------
    def finish(self, engine, tokenizer, summary: dict, curves: tuple[str, ...] = ("loss",)) -> dict:
        out_dir = checkpoint.final_dir(self.path)
        checkpoint.save_hf(engine, tokenizer, out_dir, self.cfg.engine.zero_stage, self.is_rank0)
        result = {"stage": self.job.stage, "path": str(out_dir), "steps": self.stage_cfg.steps,
                  "seconds": round(time.time() - self.started, 2), "world_size": world_size(), **summary}
        if self.is_rank0:
            if self.job.mlflow_run_id:
                self._plot(curves)
            checkpoint.mark_done(self.path, result)
        barrier()
        return result

    def _plot(self, curves: tuple[str, ...]) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.steps.records()
        present = [c for c in curves if any(c in r for r in records)]
        if not present:
            return
        fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.2), squeeze=False)
        for ax, name in zip(axes[0], present):
            pts = [(r["step"], r[name]) for r in records if name in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
            ax.set_title(f"{self.job.stage} {name}")
            ax.set_xlabel("step")
        tracking.log_figure(fig, f"plots/{self.job.stage}_curves.png", run_id=self.job.mlflow_run_id)


def handed_ref(h: StageHarness, table: str) -> TableRef | None:
    """The snapshot of ``table`` the stage was handed (``extra["sources"]``, pinned by the train
    flow when it made the job: a table it lacked then is pinned as absent), else its newest now."""
    sources = (h.job.extra or {}).get("sources")
    if sources is None:
        return Warehouse(h.job.home).latest(table)
    handed = sources.get(table)
    return TableRef.parse(handed) if handed else None
