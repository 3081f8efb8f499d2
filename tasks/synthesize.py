"""The synthesize stage: generate SynLogic-style instances into ``synthetic_tasks`` and
calibrate task difficulty into ``task_calibration``.

``run_synthesis`` draws ``per_task`` instances per task, round-robin over the task's levels
(its calibrated band when ``task_calibration`` has a row for it, else the profile's levels),
each from a seed derived from (run seed, task, draw index). Identical instances (same task,
prompt and gold answer) are dropped, counted, and recorded in ``decisions``; drawing goes on
until ``per_task`` distinct instances exist or ``max_draws_per_instance * per_task`` draws
were made. The same arguments always give the same table content.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import polars as pl

from data_specs import get_spec
from tasks import tracking
from tasks.synth.base import SynthTask, stable_int
from tasks.synth.calibration import STATUS_TOO_HARD, Solver, calibrate_task
from tasks.synth.config import SynthesizeConfig, SyntheticSplitConfig
from tasks.synth.registry import get_task, own_task_names
from tasks.text import hash_fraction, normalize_texts, text_hash
from warehouse import TableRef, Warehouse

SYNTHETIC_TABLE = "synthetic_tasks"
CALIBRATION_TABLE = "task_calibration"
CALIBRATION_SAMPLES_TABLE = "calibration_samples"
DECISIONS_TABLE = "decisions"
DEDUP_STAGE = "synthesize_dedup"


class SynthesisConfigError(ValueError):
    """The synthesize section asks for something impossible (unknown task, bad level)."""


# how generation runs over tasks: in order here; the synthesize flow passes one that runs each
# task as its own Prefect task run on the flow's task runner
Mapper = Callable[[Callable[..., dict[str, Any]], list[tuple]], list[dict[str, Any]]]


def sequential_map(fn: Callable[..., dict[str, Any]], calls: list[tuple]) -> list[dict[str, Any]]:
    return [fn(*args) for args in calls]


# --- which levels each task draws from --------------------------------------------------------

def read_calibration(wh: Warehouse) -> tuple[dict[str, dict[str, Any]], TableRef | None]:
    ref = wh.latest(CALIBRATION_TABLE)
    if ref is None:
        return {}, None
    rows = wh.read(CALIBRATION_TABLE, ref.snapshot).to_dicts()
    return {r["task"]: r for r in rows}, ref


def configured_levels(cfg: SynthesizeConfig, synth_task: SynthTask) -> list[int]:
    wanted = cfg.levels.get(synth_task.name, cfg.default_levels)
    if wanted is None:
        return list(range(synth_task.n_levels))
    bad = [lv for lv in wanted if not 0 <= lv < synth_task.n_levels]
    if bad or not wanted:
        field = f"levels.{synth_task.name}" if synth_task.name in cfg.levels else "default_levels"
        raise SynthesisConfigError(
            f"synthesize.{field}: levels {bad or wanted} not usable for task {synth_task.name!r} "
            f"(it has levels 0..{synth_task.n_levels - 1})")
    return sorted(set(wanted))


def levels_for(cfg: SynthesizeConfig, synth_task: SynthTask,
               calibration: dict[str, dict[str, Any]]) -> tuple[list[int], str]:
    """(levels, "calibrated" | "configured"); no levels when calibration marks it too hard."""
    row = calibration.get(synth_task.name) if cfg.use_calibration else None
    if row is None:
        return configured_levels(cfg, synth_task), "configured"
    if row["status"] == STATUS_TOO_HARD and cfg.skip_too_hard:
        return [], "calibrated"
    upper = min(int(row["upper_level"]), synth_task.n_levels - 1)
    return list(range(min(int(row["lower_level"]), upper), upper + 1)), "calibrated"


# --- generation ------------------------------------------------------------------------------

def synthetic_cluster_id(task_name: str, question: str) -> str:
    """Same task and same normalized question: the same puzzle, whatever its seed."""
    return f"{task_name}:{text_hash(normalize_texts([question])[0])}"


def synthetic_side(cluster_id: str, split: SyntheticSplitConfig) -> str:
    """'rl' or 'sft' for a cluster: seeded, stable, and the same for every member."""
    return "rl" if hash_fraction(cluster_id, split.seed) < split.rl_fraction else "sft"


def generate_task_instances(task_name: str, levels: list[int], per_task: int, seed: int,
                            max_draws_per_instance: int, level_source: str,
                            split: SyntheticSplitConfig | None = None) -> dict[str, Any]:
    """Distinct instances of one task, plus one record per dropped duplicate draw."""
    synth_task = get_task(task_name)
    split = split or SyntheticSplitConfig()
    rows: list[dict[str, Any]] = []
    duplicates: list[dict[str, Any]] = []
    seen: set[str] = set()
    max_draws = per_task * max_draws_per_instance
    draw = 0
    while levels and len(rows) < per_task and draw < max_draws:
        level = levels[draw % len(levels)]
        instance_seed = stable_int("synthesize", seed, task_name, draw)
        inst = synth_task.generate(instance_seed, level)
        draw += 1
        if inst.id in seen:
            duplicates.append({"row_id": f"{task_name}/level={level}/seed={instance_seed}",
                               "reference_id": inst.id})
            continue
        seen.add(inst.id)
        cluster = synthetic_cluster_id(task_name, inst.question or inst.prompt)
        rows.append({
            "id": inst.id, "task": inst.task, "family": synth_task.family, "level": inst.level,
            "seed": inst.seed, "prompt": inst.prompt, "question": inst.question,
            "answer": inst.answer, "metadata": inst.metadata_json(), "domain": "logic",
            "level_source": level_source, "cluster_id": cluster, "split": synthetic_side(cluster, split),
        })
    return {"task": task_name, "rows": rows, "duplicates": duplicates, "draws": draw}


def _generate_all(plan: list[tuple[str, list[int], str, int]], seed: int,
                  max_draws: int, split: SyntheticSplitConfig, mapper: Mapper | None = None) -> list[dict[str, Any]]:
    return (mapper or sequential_map)(generate_task_instances, [(name, levels, count, seed, max_draws, source, split)
                                                               for name, levels, source, count in plan])


def level_distribution_figure(counts: dict[str, Counter]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(counts)
    max_level = max((lv for c in counts.values() for lv in c), default=0)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(names) + 2), 4.0))
    bottom = [0] * len(names)
    cmap = plt.get_cmap("viridis", max_level + 1)
    for level in range(max_level + 1):
        heights = [counts[n].get(level, 0) for n in names]
        ax.bar(names, heights, bottom=bottom, color=cmap(level), label=f"level {level}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("instances")
    ax.set_title("synthetic_tasks: instances per task and level")
    ax.tick_params(axis="x", labelrotation=75, labelsize=7)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _log_synthesis(counts: dict[str, Counter], n_duplicates: dict[str, int], skipped: list[str],
                   ref: TableRef) -> None:
    metrics: dict[str, float] = {"rows": ref.rows, "duplicates": sum(n_duplicates.values()),
                                 "tasks": len(counts), "tasks_skipped_too_hard": len(skipped)}
    for name, per_level in counts.items():
        metrics[f"{name}.rows"] = sum(per_level.values())
        metrics[f"{name}.duplicates"] = n_duplicates.get(name, 0)
        for level, n in sorted(per_level.items()):
            metrics[f"{name}.level_{level}"] = n
    tracking.log_counters(metrics, prefix="synthesize")
    tracking.log_table(ref, context="output")
    tracking.log_figure(level_distribution_figure(counts), "plots/synthetic_level_distribution.png")


def _write_synthesis(wh: Warehouse, results: list[dict[str, Any]], plan: list, calibration_ref: TableRef | None,
                     run_id: str) -> TableRef:
    rows = [row for r in results for row in r["rows"]]
    frame = pl.DataFrame(rows, schema={
        "id": pl.Utf8, "task": pl.Utf8, "family": pl.Utf8, "level": pl.Int64, "seed": pl.Int64,
        "prompt": pl.Utf8, "question": pl.Utf8, "answer": pl.Utf8, "metadata": pl.Utf8,
        "domain": pl.Utf8, "level_source": pl.Utf8, "cluster_id": pl.Utf8, "split": pl.Utf8,
    })
    calibrated = any(source == "calibrated" for _, _, source, _ in plan)
    parents = (calibration_ref,) if calibration_ref is not None and calibrated else ()
    ref = wh.write(SYNTHETIC_TABLE, frame, parents=parents)
    duplicates = [{"row_id": d["row_id"], "stage": DEDUP_STAGE, "decision": "removed",
                   "reason": "duplicate-of", "reference_id": d["reference_id"], "score": None,
                   "run_id": run_id} for r in results for d in r["duplicates"]]
    if duplicates:
        wh.append(DECISIONS_TABLE, pl.DataFrame(duplicates, schema={
            "row_id": pl.Utf8, "stage": pl.Utf8, "decision": pl.Utf8, "reason": pl.Utf8,
            "reference_id": pl.Utf8, "score": pl.Float64, "run_id": pl.Utf8}), parents=(ref,))
    return ref


def run_synthesis(wh: Warehouse, cfg: SynthesizeConfig, per_task: int | None = None,
                  tasks: list[str] | None = None, seed: int | None = None, mapper: Mapper | None = None,
                  log: Callable[[str], None] | None = None) -> TableRef:
    """Fill ``synthetic_tasks`` (replacing its content) and return the new snapshot's ref.

    ``per_task``, ``tasks`` and ``seed`` override the config when given. ``log`` hears which
    tasks calibration left out (no valid band) and which have no calibration row (drawn at the
    profile's levels).
    """
    per_task = cfg.per_task if per_task is None else per_task
    seed = cfg.seed if seed is None else seed
    if per_task < 1:
        raise SynthesisConfigError(f"synthesize.per_task must be >= 1, got {per_task}")
    names = list(tasks) if tasks is not None else cfg.task_names(own_task_names())
    synth_tasks = [get_task(n) for n in names]   # raises TaskError naming an unknown task
    calibration, calibration_ref = read_calibration(wh) if cfg.use_calibration else ({}, None)
    plan = []
    skipped = []
    for synth_task in synth_tasks:
        levels, source = levels_for(cfg, synth_task, calibration)
        if not levels:
            skipped.append(synth_task.name)
            continue
        plan.append((synth_task.name, levels, source, cfg.per_task_by_task.get(synth_task.name, per_task)))
    unbanded = [name for name, _, source, _ in plan if source == "configured"] if calibration else []
    if log and skipped:
        log(f"synthesize: {len(skipped)} task(s) skipped, calibration found no level the strong solver "
            f"solves (too_hard): {', '.join(skipped)}")
    if log and unbanded:
        log(f"synthesize: {len(unbanded)} task(s) have no calibration row and are drawn at the profile's "
            f"levels: {', '.join(unbanded)}")

    with tracking.stage_run("synthesize", {"per_task": per_task, "seed": seed, "tasks": json.dumps(names)}) as run_id:
        results = _generate_all(plan, seed, cfg.max_draws_per_instance, cfg.split, mapper)
        ref = _write_synthesis(wh, results, plan, calibration_ref, run_id)
        counts = {r["task"]: Counter(row["level"] for row in r["rows"]) for r in results}
        n_duplicates = {r["task"]: len(r["duplicates"]) for r in results}
        _log_synthesis(counts, n_duplicates, skipped, ref)
    return ref


# --- calibration -----------------------------------------------------------------------------

def solver_name(solver: Solver) -> str:
    return str(getattr(solver, "name", None) or getattr(solver, "__name__", None) or type(solver).__name__)


def task_fingerprint(synth_task: SynthTask, cfg: SynthesizeConfig) -> list:
    """What a task's calibration depends on of the task itself: its levels and the first probe
    instance of each (a changed generator changes them)."""
    from tasks.synth.calibration import probe_instances

    ccfg = cfg.calibration
    return [synth_task.name, synth_task.level_params(),
            [probe_instances(synth_task, level, 1, ccfg.seed)[0].id for level in range(synth_task.n_levels)]]


def calibration_key(synth_task: SynthTask, cfg: SynthesizeConfig, base_name: str, strong_name: str) -> str:
    """A task's calibration stands while this is unchanged: the task, both solvers (names that
    say which model, e.g. ``smol@<path>``) and the probe settings."""
    settings = cfg.calibration.model_dump(exclude={"enabled"})
    return f"{stable_int('calibration', task_fingerprint(synth_task, cfg), base_name, strong_name, settings):016x}"


def run_calibration(wh: Warehouse, cfg: SynthesizeConfig, solver_base: Solver, solver_strong: Solver,
                    tasks: list[str] | None = None, log: Callable[[str], None] | None = None) -> TableRef:
    """Store each task's band in ``task_calibration`` and the samples that decided it in
    ``calibration_samples``. A task whose row holds the same ``calibration_key`` (same task, same
    solvers, same settings) keeps it; the others are probed with both solvers. Rows of tasks not
    asked about are carried over. ``log`` hears one line per task."""
    names = list(tasks) if tasks is not None else cfg.task_names(own_task_names())
    ccfg = cfg.calibration
    base_name, strong_name = solver_name(solver_base), solver_name(solver_strong)
    previous = wh.latest(CALIBRATION_TABLE)
    before = {r["task"]: r for r in wh.read_ref(previous).to_dicts()} if previous is not None else {}
    rows, samples, probed = [], [], []
    for name in names:
        synth_task = get_task(name)
        key = calibration_key(synth_task, cfg, base_name, strong_name)
        if (before.get(name) or {}).get("calibration_key") == key:
            rows.append(before[name])
            if log:
                log(f"calibration {name}: unchanged since it was probed, levels "
                    f"{before[name]['lower_level']}-{before[name]['upper_level']} ({before[name]['status']})")
            continue
        drawn: list[dict] = []
        result = calibrate_task(synth_task, solver_base, solver_strong, ccfg, drawn)
        rows.append({**result.to_row(ccfg, base_name, strong_name), "calibration_key": key})
        names_of = {"base": base_name, "strong": strong_name}
        samples += [{**d, "task": name, "calibration_key": key, "solver_name": names_of[d["solver"]]} for d in drawn]
        probed.append(name)
        if log:
            log(f"calibration {name}: levels {result.lower_level}-{result.upper_level} ({result.status}) from "
                f"{len(drawn)} samples over {len(result.probes)} level(s): "
                + ", ".join(f"L{p.level} base {p.base_pass_rate:.2f} strong pass@{ccfg.strong_k} {p.strong_pass_at_k:.2f}"
                            for p in result.probes))
    frame = get_spec(CALIBRATION_TABLE).conform(pl.DataFrame(rows, infer_schema_length=None))
    if previous is not None:
        kept = get_spec(CALIBRATION_TABLE).conform(wh.read_ref(previous)).filter(~pl.col("task").is_in(names))
        frame = pl.concat([kept, frame])
    frame = frame.sort("task")
    if previous is not None and not probed and frame.equals(get_spec(CALIBRATION_TABLE).conform(wh.read_ref(previous))):
        ref = previous   # nothing probed, nothing changed: the standing snapshot
    else:
        ref = wh.write(CALIBRATION_TABLE, frame, parents=(previous,) if previous is not None else ())
    if samples:
        wh.append(CALIBRATION_SAMPLES_TABLE, get_spec(CALIBRATION_SAMPLES_TABLE).conform(
            pl.DataFrame(samples, infer_schema_length=None)), parents=(ref,))

    with tracking.stage_run("calibrate", {"base_solver": base_name, "strong_solver": strong_name}):
        metrics: dict[str, float] = {"tasks": len(rows), "tasks_probed": len(probed), "samples": len(samples)}
        for row in rows:
            metrics[f"{row['task']}.lower_level"] = row["lower_level"]
            metrics[f"{row['task']}.upper_level"] = row["upper_level"]
        metrics.update(Counter(f"status.{row['status']}" for row in rows))
        tracking.log_counters(metrics, prefix="calibration")
        tracking.log_table(ref, context="output")
    return ref


def calibration_summary(wh: Warehouse, ref: TableRef, tasks: list[str]) -> list[dict[str, Any]]:
    """Each task's band as the run summary shows it (``tasks`` in that order)."""
    rows = {r["task"]: r for r in wh.read_ref(ref).to_dicts()}
    return [{"task": t, "lower_level": rows[t]["lower_level"], "upper_level": rows[t]["upper_level"],
             "n_levels": rows[t]["n_levels"], "status": rows[t]["status"]} for t in tasks if t in rows]


def band_levels(band: dict[str, Any]) -> str:
    """A calibrated band as a summary shows it: ``lower-upper``, or ``skipped`` (no valid band)."""
    if band["status"] == STATUS_TOO_HARD:
        return "skipped"
    return f"{band['lower_level']}-{band['upper_level']}"
