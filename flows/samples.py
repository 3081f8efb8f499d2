"""The ``samples`` flow: sample the SFT side's prompts, verify, clean, record.

``job="teacher"``: a teacher's reasoning for SFT by rejection sampling (``teacher_samples``;
by default the base model itself, rejection-sampling fine-tuning). ``job="on_policy"``: the
model DPO starts from samples the same prompts; its verified-correct and verified-wrong samples
become DPO pairs (``rollouts``). A job the profile leaves disabled writes nothing, and the
builders fall back (gold targets; perturbed rejected sides), counting it.
"""
from __future__ import annotations

from prefect import flow

from data_specs.stages import train_stage
from flows.common import flow_context, flow_logger, report_progress
from tasks.genrm.models import resolve_model_name
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import make_backend
from tasks.samples import SampleJob, SamplesConfig, run_samples
from tasks.train.base_model import prepare_base_model
from tasks.train.config import TrainConfig
from warehouse import TableRef, Warehouse

BASE_MODEL = "base"


def job_model(job: SampleJob, wh: Warehouse, train: TrainConfig, model_section: dict,
              sources: dict[str, TableRef] | None, model: str | None = None) -> str:
    """The sampling model: ``base`` is the model the first training stage starts from; a training
    stage's name its newest model; anything else an alias or a path."""
    name = model or job.model
    if name == BASE_MODEL:
        return str(prepare_base_model(wh, train.base_model, model_section, train.seed, sources))
    return resolve_model_name(name, wh.home, sources)


@flow(name="samples", log_prints=True, flow_run_name="samples {job}")
def samples_flow(job: str = "teacher", profile: str = "tiny", home: str | None = None, model: str | None = None,
                 sources: dict[str, TableRef] | None = None) -> dict:
    """Sample, verify and clean the SFT side's prompts for ``job`` (teacher / on_policy), each
    table at its snapshot in ``sources`` (the pipeline hands them over), else its newest."""
    log = flow_logger()
    report_progress(job, "start")
    with flow_context(f"samples {job}", profile, home, {"job": job, "model": model},
                      sections=("samples", "rollout", "train", "model")) as ctx:
        cfg = ctx.profile.section("samples", SamplesConfig)
        settings: SampleJob = getattr(cfg, job)
        train = ctx.profile.section("train", TrainConfig)
        if job == "on_policy" and model is None and not any(train_stage(s).recipe == "dpo" for s in train.stages):
            reason = f"no DPO stage in train.stages ({', '.join(train.stages)}): on-policy samples make DPO pairs only"
            log.info("samples %s: %s; nothing sampled", job, reason)
            report_progress(job, "done")
            return {"mlflow_run_id": ctx.run_id, "tables": {}, "counts": {}, "model": None, "enabled": False,
                    "idle": reason}
        if not settings.enabled and model is None:
            log.info("samples %s: disabled in profile %s (samples.%s.enabled); nothing sampled", job, profile, job)
            report_progress(job, "done")
            return {"mlflow_run_id": ctx.run_id, "tables": {}, "counts": {}, "model": None, "enabled": False}
        chosen = job_model(settings, ctx.wh, train, ctx.profile.raw("model"), sources, model)
        rollout = ctx.profile.section("rollout", RolloutConfig)
        backend = make_backend(rollout.model_copy(update={"model": chosen}))
        log.info("samples %s: sampling with %s (n=%d, T=%.2f, max_tokens=%d)", job, chosen,
                 settings.sampling.n, settings.sampling.temperature, settings.sampling.max_tokens)
        refs, counts = run_samples(ctx.wh, job, cfg, backend, train.data.synthetic_per_task, train.seed, sources)
        log.info("samples %s: %s", job, {k: int(v) for k, v in counts.items()})
        report_progress(job, "done")
        return {"mlflow_run_id": ctx.run_id, "tables": ctx.log_outputs(refs), "counts": counts, "model": chosen,
                "enabled": True}
