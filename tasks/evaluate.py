"""Held-out evaluation: pass@k at temperature 1.0, top-p 0.95 (the MiniMax-M1 setting).

Items come from the ``benchmarks`` table (AIME 2024/2025, MATH500, HumanEval, ...) and from
freshly generated synthetic tasks that training never saw. Each item gets ``n`` samples;
each sample is scored by the domain's verifier (code runs in the sandbox); an item's
pass@k is the unbiased estimate from its n samples, and a benchmark's pass@k is the mean
over its items.

Held-out synthetic seeds: instance ``i`` of every task uses seed ``-(1 + i)``. The
synthesize and calibration stages derive their seeds with ``stable_int`` (always >= 0),
so the two seed ranges never meet. Because a small level can produce the same puzzle from
two different seeds, an instance whose content id is already in ``synthetic_tasks`` is
skipped as well, and counted.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from data_specs.stages import last_of, phase_ends
from tasks.agents.evaluate import AgentHeldout, evaluate_agent
from tasks.model_registry import audited_row, pipeline_models, read_models, refuse_failed_audit
from tasks.passk import pass_at_k
from tasks.rollout.base import RolloutBackend, SamplingParams
from tasks.rollout.factory import resolve_model
from tasks.scoring import VerifySettings, render_prompt, score_samples
from tasks.synth.base import heldout_seed, normalize_text
from tasks.synth.registry import get_task, own_task_names
from warehouse import TableRef, Warehouse

SYNTHETIC_BENCHMARK = "synthetic_heldout"
UNTRAINED_BENCHMARK = "untrained_heldout"   # families no stage trains on, pooled like SYNTHETIC_BENCHMARK
HELDOUT_GROUPS = (SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK)
MODELS_TABLE = "models"
ANSWER_STOP = "</answer>"   # the logic extractor's closing tag (tasks.synth.base.extract_answer)


class SyntheticHeldout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tasks: list[str] | None = Field(None, description="own task names or rg:<dataset>; None = every own task")
    per_task: int = Field(8, ge=1)
    levels: list[int] | None = Field(None, description="None: every level of the task, round-robin")
    levels_by_task: dict[str, list[int]] = Field(default_factory=dict, description="levels for particular tasks")
    max_draws_per_instance: int = Field(4, ge=1, description="draws allowed per wanted instance")
    untrained: list[str] = Field(
        default_factory=list, description="families no stage trains on (own task names or rg:<dataset>), scored "
                                          "apart from the trained ones: what training does to skills it never saw")
    per_task_untrained: int | None = Field(None, ge=1, description="items per untrained family (None: per_task)")

    @model_validator(mode="after")
    def _apart(self) -> SyntheticHeldout:
        both = sorted(set(self.tasks or []) & set(self.untrained))
        if both:
            raise ValueError(f"evaluate.synthetic: {both} listed both in tasks (trained) and in untrained")
        return self


LADDER = ("base", *phase_ends())   # the model before training, then the end of each recipe phase


class EvaluateConfig(VerifySettings):
    """The ``evaluate`` profile section. Defaults follow M1's evaluation protocol."""

    # With no model named: these stages' models of the newest training run, in order, so a
    # run shows what each stage did ("base" = the model its first stage started from).
    stages: list[str] = Field(default_factory=lambda: list(LADDER))

    benchmarks: list[str] = Field(default_factory=lambda: ["aime2024", "aime2025", "math500", "humaneval"])
    benchmark_stages: list[str] | None = Field(
        None, description="the ladder stages the public benchmarks are scored at (None: every stage); the trained "
                          "held-out synthetic families are scored at every stage (the never-trained ones at "
                          "untrained_stages). For a small model that scores 0 on them throughout, [base, rl] keeps "
                          "the first-vs-last check at half the cost")
    untrained_stages: list[str] | None = Field(
        None, description="the ladder stages the never-trained families (synthetic.untrained) are scored at "
                          "(None: every stage); [base, rl, ...] keeps the first-vs-last check the verdict makes "
                          "at a fraction of the cost")
    max_items: int | None = Field(None, ge=1, description="items per benchmark; None = all")
    max_items_per_benchmark: dict[str, int] = Field(default_factory=dict)
    n: int = Field(32, ge=1, description="samples per item (M1 averages pass@1 over 32 samples)")
    k: list[int] = Field(default_factory=lambda: [1])
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(40_000, ge=1)
    seed: int = 0
    synthetic: SyntheticHeldout | None = Field(default_factory=SyntheticHeldout)
    agent: AgentHeldout | None = Field(None, description="held-out environment episodes, scored as success rate")
    prompts_per_chunk: int = Field(32, ge=1, description="prompts sent to the backend at once")
    stop_at_answer: bool = Field(
        True, description="logic items stop sampling at the first </answer>: the answer the model commits to "
                          "first is the one scored (turn off for a model that closes answer tags inside its "
                          "thinking)")

    @model_validator(mode="after")
    def _k_fits_n(self) -> EvaluateConfig:
        if not self.k:
            raise ValueError("k must list at least one value")
        bad = [k for k in self.k if k < 1 or k > self.n]
        if bad:
            raise ValueError(f"every k must be in 1..n={self.n}; got {bad}")
        return self

    @model_validator(mode="after")
    def _benchmark_stages_are_ladder_stages(self) -> EvaluateConfig:
        for what, named in (("benchmark_stages", self.benchmark_stages),
                            ("untrained_stages", self.untrained_stages),
                            ("agent.stages", self.agent.stages if self.agent else None)):
            unknown = [st for st in named or [] if st not in self.stages]
            if unknown:
                raise ValueError(f"evaluate.{what} {unknown} are not among evaluate.stages {self.stages}")
        return self

    def scores_at(self, item: EvalItem, stage: str | None) -> bool:
        """Whether ``item`` is scored for the model of ``stage`` (a model named by hand: every item)."""
        group = heldout_group(item.benchmark)
        named = self.untrained_stages if group == UNTRAINED_BENCHMARK else (
            self.benchmark_stages if group is None else None)
        return named is None or stage is None or stage in named

    def items_limit(self, benchmark: str) -> int | None:
        return self.max_items_per_benchmark.get(benchmark, self.max_items)

    def sampling_params(self, domain: str | None = None) -> SamplingParams:
        """One random stream per sample (``seed_per_sequence``): an item's samples do not depend
        on the batch it shares or on a stop elsewhere, and every stage draws the same uniforms on
        the same item (common random numbers for the paired intervals). No repetition truncation
        at evaluation: a truncated sample would be scored on a response the model did not finish."""
        stop = (ANSWER_STOP,) if domain == "logic" and self.stop_at_answer else ()
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed, repetition_window=None, stop=stop, seed_per_sequence=True)


# -- which model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelChoice:
    model_id: str
    path: str
    source: str   # "argument" or "models table"
    stage: str | None = None
    registered_id: str | None = None   # an argument that is a registered model: its models.model_id


def choose_model(wh: Warehouse, model: str | None = None, accept_failed_audit: bool = False,
                 sources: Mapping[str, TableRef] | None = None) -> ModelChoice:
    """The explicit ``model`` (alias or path) or else the newest row of the ``models`` table (at
    the snapshot handed over in ``sources``); a registered model whose training-data audit failed
    is refused unless accepted."""
    if model:
        path = str(resolve_model(model))
        row = audited_row(wh, path)
        if row is not None:
            refuse_failed_audit(row, accept_failed_audit)
        return ModelChoice(model_id=model, path=path, source="argument",
                           registered_id=str(row["model_id"]) if row is not None else None)
    models = pipeline_models(read_models(wh, sources))
    if models.is_empty():
        raise LookupError(
            f"no model to evaluate: the {MODELS_TABLE!r} table in {wh.home} is empty or missing and no "
            f"model was given; train one (`posttrain run --stage train`) or pass --model PATH_OR_ALIAS")
    row = models.tail(1).row(0, named=True)
    missing = [c for c in ("model_id", "path") if not row.get(c)]
    if missing:
        raise LookupError(f"the newest row of {MODELS_TABLE!r} has no {missing}: cannot load it")
    if not Path(row["path"]).exists():
        raise FileNotFoundError(
            f"model {row['model_id']!r} from the {MODELS_TABLE!r} table points at {row['path']}, which does not exist")
    refuse_failed_audit(row, accept_failed_audit)
    return ModelChoice(model_id=str(row["model_id"]), path=str(row["path"]), source="models table")


def stage_ladder(wh: Warehouse, stages: list[str], accept_failed_audit: bool = False,
                 sources: Mapping[str, TableRef] | None = None) -> list[ModelChoice]:
    """The newest training run's model after each of ``stages`` (those it has), in order, from the
    ``models`` snapshot handed over in ``sources`` (else the newest); a model whose training-data
    audit failed is refused unless accepted."""
    newest = choose_model(wh, accept_failed_audit=accept_failed_audit, sources=sources)
    models = pipeline_models(read_models(wh, sources))
    run = models.filter(pl.col("model_id") == newest.model_id)["run_name"][-1]
    rows = models.filter(pl.col("run_name") == run)
    out = []
    for stage in stages:
        if stage == "base":
            first = rows.head(1).row(0, named=True)
            out.append(ModelChoice(f"{run}/base", first["init_model"], "models table", "base"))
            continue
        match = rows.filter(pl.col("stage") == stage)
        if match.height:
            r = match.row(-1, named=True)
            refuse_failed_audit(r, accept_failed_audit)
            out.append(ModelChoice(r["model_id"], r["path"], "models table", stage))
    missing = [c.path for c in out if not Path(c.path).exists()]
    if missing:
        raise FileNotFoundError(f"models of run {run!r} point at missing directories: {missing}")
    return out or [newest]


# -- which items ---------------------------------------------------------------------------------

@dataclass
class EvalItem:
    benchmark: str
    item_id: str
    domain: str
    row: dict   # what the verifier reads: prompt, answer / tests, entry_point, metadata


def benchmark_items(wh: Warehouse, cfg: EvaluateConfig, sources: Mapping[str, TableRef] | None = None
                    ) -> list[EvalItem]:
    """``max_items`` items of each configured benchmark (from the ``benchmarks`` snapshot handed
    over in ``sources``, else the newest), a seeded sample in item_id order."""
    if not cfg.benchmarks:
        return []
    ref = wh.pinned("benchmarks", sources)
    if ref is None:
        raise LookupError(f"no `benchmarks` table in {wh.home}: run `posttrain ingest --bundled` first")
    table = wh.read_ref(ref)
    available = sorted(table.get_column("benchmark").unique().to_list())
    items: list[EvalItem] = []
    for name in cfg.benchmarks:
        rows = table.filter(pl.col("benchmark") == name).sort("item_id")
        if rows.height == 0:
            raise LookupError(f"evaluate.benchmarks: {name!r} has no rows in `benchmarks`; available: {available}")
        limit = cfg.items_limit(name)
        if limit is not None and rows.height > limit:
            rows = rows.sample(n=limit, seed=cfg.seed).sort("item_id")
        for r in rows.iter_rows(named=True):
            verifier_row = {"id": f"{name}:{r['item_id']}", "prompt": r["text"], "answer": r["answer"],
                            "tests": r["tests"], "entry_point": r["entry_point"], "metadata": r["metadata"],
                            "domain": r["domain"]}
            items.append(EvalItem(name, str(r["item_id"]), r["domain"], verifier_row))
    return items


QUESTION_KEY = "question:"


def question_key(text: str) -> str:
    """How a held-out question is matched against training text (whitespace and case folded)."""
    return QUESTION_KEY + normalize_text(text)


def training_instance_ids(wh: Warehouse, sources: Mapping[str, TableRef] | None = None) -> set[str]:
    """What a held-out item must not be: a synthetic instance id, or the question text of any
    prompt that could train (a pool row or an ingested prompt holding the same generator's
    question: reasoning-gym's easiest levels draw from a few hundred distinct questions). Each
    table at the snapshot handed over in ``sources``, else its newest."""
    out: set[str] = set()
    if (ref := wh.pinned("synthetic_tasks", sources)) is not None:
        synth = wh.read_ref(ref)
        out |= set(synth.get_column("id").to_list())
        if "question" in synth.columns:
            out |= {question_key(q) for q in synth.get_column("question").to_list() if q}
    for table in ("prompts", "sft_pool", "rl_pool"):
        if (ref := wh.pinned(table, sources)) is not None:
            out |= {question_key(p) for p in wh.read_ref(ref).get_column("prompt").to_list() if p}
    return out


@dataclass
class HeldoutDraw:
    items: list[EvalItem] = field(default_factory=list)
    skipped_seen_in_training: int = 0
    skipped_duplicates: int = 0


def synthetic_benchmark(task: str, untrained: bool = False) -> str:
    """Held-out synthetic items are reported per task family, and pooled as SYNTHETIC_BENCHMARK
    (families training draws from) or UNTRAINED_BENCHMARK (families no stage trains on)."""
    return f"{UNTRAINED_BENCHMARK if untrained else SYNTHETIC_BENCHMARK}/{task}"


def heldout_group(benchmark: str) -> str | None:
    """The pooled benchmark a held-out family belongs to (None for a public benchmark)."""
    return next((g for g in HELDOUT_GROUPS if benchmark.startswith(f"{g}/")), None)


def trained_task_names(wh: Warehouse, sources: Mapping[str, TableRef] | None = None) -> set[str]:
    """The synthetic task families of the home's training data (``synthetic_tasks``, at the
    snapshot handed over in ``sources``, else its newest)."""
    ref = wh.pinned("synthetic_tasks", sources)
    if ref is None:
        return set()
    table = wh.read_ref(ref)
    return set(table.get_column("task").unique().to_list()) if "task" in table.columns else set()


def heldout_synthetic_items(spec: SyntheticHeldout, training_ids: set[str],
                            trained_tasks: set[str] | None = None) -> HeldoutDraw:
    """Fresh instances per task from the reserved (negative) seed range, none seen in training;
    the ``untrained`` families too, refused if training drew from one of them (``trained_tasks``)."""
    out = HeldoutDraw()
    trained_too = sorted(set(spec.untrained) & (trained_tasks or set()))
    if trained_too:
        raise ValueError(f"evaluate.synthetic.untrained: {trained_too} are in this home's training data "
                         "(synthetic_tasks): a family a stage trains on cannot measure what training does to "
                         "unseen skills; move it to evaluate.synthetic.tasks")
    families = [(name, False) for name in (spec.tasks if spec.tasks is not None else own_task_names())]
    families += [(name, True) for name in spec.untrained]
    for name, untrained in families:
        task = get_task(name)
        levels = spec.levels_by_task.get(name, spec.levels)
        levels = levels if levels is not None else list(range(task.n_levels))
        bad = [lv for lv in levels if not 0 <= lv < task.n_levels]
        if bad or not levels:
            raise ValueError(f"evaluate.synthetic.levels {bad or levels} not usable for task {name!r} "
                             f"(levels 0..{task.n_levels - 1})")
        seen: set[str] = set()
        draw = 0
        wanted = spec.per_task_untrained if untrained and spec.per_task_untrained is not None else spec.per_task
        while len(seen) < wanted and draw < wanted * spec.max_draws_per_instance:
            inst = task.generate(heldout_seed(draw), levels[draw % len(levels)])
            draw += 1
            if inst.id in training_ids or question_key(inst.question) in training_ids:
                out.skipped_seen_in_training += 1
                continue
            if inst.id in seen:
                out.skipped_duplicates += 1
                continue
            seen.add(inst.id)
            row = {"id": inst.id, "task": inst.task, "level": inst.level, "seed": inst.seed,
                   "prompt": inst.prompt, "question": inst.question, "answer": inst.answer,
                   "metadata": inst.metadata_json(), "domain": "logic"}
            out.items.append(EvalItem(synthetic_benchmark(inst.task, untrained),
                                      f"{inst.task}/{inst.level}/{inst.seed}", "logic", row))
    return out


# -- sampling and scoring ------------------------------------------------------------------------

@dataclass
class ItemResult:
    item: EvalItem
    n: int
    correct: int
    mean_tokens: float
    verify_errors: int
    first_error: str | None


def evaluate_items(items: list[EvalItem], backend: RolloutBackend, cfg: EvaluateConfig,
                   progress=None) -> list[ItemResult]:
    """Sample ``cfg.n`` completions per item and score each; one failed score never stops the batch.
    Items go to the backend a domain at a time (each domain's stop strings), ``prompts_per_chunk``
    at a time; results come back in the order of ``items``."""
    limits = cfg.sandbox_limits()
    by_domain: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_domain.setdefault(it.domain, []).append(i)
    results: dict[int, ItemResult] = {}
    with ThreadPoolExecutor(max_workers=cfg.verify_workers) as pool:
        for domain, indices in by_domain.items():
            params = cfg.sampling_params(domain)
            for start in range(0, len(indices), cfg.prompts_per_chunk):
                chunk = indices[start:start + cfg.prompts_per_chunk]
                prompts = [render_prompt(items[i].row, domain, cfg, backend) for i in chunk]
                for i, completions in zip(chunk, backend.generate(prompts, params)):
                    scored = score_samples(domain, items[i].row, completions, limits, pool)
                    errors = [s.error for s in scored if s.error]
                    results[i] = ItemResult(
                        item=items[i], n=len(scored), correct=sum(1 for s in scored if s.reward >= 1.0),
                        mean_tokens=sum(len(s.completion.token_ids) for s in scored) / max(1, len(scored)),
                        verify_errors=len(errors), first_error=errors[0] if errors else None)
                if progress is not None:
                    progress(len(results), len(items))
    return [results[i] for i in range(len(items))]


def evaluate_environments(backend: RolloutBackend, cfg: EvaluateConfig) -> list[ItemResult]:
    """The held-out environment episodes of ``cfg.agent``, as items: an episode's samples, its successes."""
    return [ItemResult(EvalItem(s.benchmark, s.item_id, "agent", s.row), s.n, s.successes, s.mean_tokens, s.errors,
                       s.first_error)
            for s in evaluate_agent(backend, cfg.agent, cfg.temperature, cfg.top_p, cfg.seed)]


def summarize(results: list[ItemResult], cfg: EvaluateConfig, model: ModelChoice, backend: str,
              run_id: str | None) -> pl.DataFrame:
    """One ``eval_results`` row per (benchmark, k): the mean unbiased pass@k over items."""
    created = datetime.now(UTC).replace(tzinfo=None)
    by_benchmark: dict[str, list[ItemResult]] = {}
    for r in results:
        by_benchmark.setdefault(r.item.benchmark, []).append(r)
        if (group := heldout_group(r.item.benchmark)) is not None:
            by_benchmark.setdefault(group, []).append(r)
    rows = []
    for bench, rs in by_benchmark.items():
        for k in cfg.k:
            rows.append({
                "model": model.model_id, "model_path": model.path, "stage": model.stage, "benchmark": bench,
                "n": cfg.n, "k": k,
                "pass_at_k": sum(pass_at_k(r.n, r.correct, k) for r in rs) / len(rs),
                "items": len(rs), "correct": sum(r.correct for r in rs),
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                "seed": cfg.seed, "backend": backend, "run_id": run_id, "created": created,
            })
    from data_specs import get_spec
    spec = get_spec("eval_results")
    return spec.conform(pl.DataFrame(rows, infer_schema_length=None)) if rows else spec.empty()


def item_rows(results: list[ItemResult], model: ModelChoice, run_id: str | None) -> pl.DataFrame:
    from data_specs import get_spec
    spec = get_spec("eval_items")
    rows = [{"model": model.model_id, "stage": model.stage, "benchmark": r.item.benchmark, "item_id": r.item.item_id,
             "domain": r.item.domain, "n": r.n, "correct": r.correct, "pass_at_1": r.correct / r.n,
             "mean_tokens": r.mean_tokens, "verify_errors": r.verify_errors, "first_error": r.first_error,
             "run_id": run_id} for r in results]
    return spec.conform(pl.DataFrame(rows, infer_schema_length=None)) if rows else spec.empty()


def ladder_intervals(results_by_stage: Mapping[str, list[ItemResult]], seed: int = 0,
                     pairs: list[tuple[str, str]] | None = None) -> list:
    """Paired 95% intervals (``tasks.heldout_stats``) of every stage-vs-stage difference the
    ladder asks for (or of ``pairs``, (a, b) for b - a), per held-out family and per pooled group
    (trained / never trained): the same items and sampling seed on both sides, bootstrapped over
    items."""
    from tasks.heldout_stats import stage_intervals

    scores = {stage: {(r.item.benchmark, r.item.item_id): r.correct / r.n for r in rs if r.n}
              for stage, rs in results_by_stage.items()}
    benches = sorted({b for by in scores.values() for b, _ in by})
    groups: dict[str, list[str]] = {}
    for group in HELDOUT_GROUPS:
        members = [b for b in benches if heldout_group(b) == group]
        groups.update({b: [b] for b in members})
        if members:
            groups[group] = members
    return stage_intervals(scores, groups, pairs=pairs, seed=seed)


def pass_at_k_metrics(summary: pl.DataFrame, stage: str | None = None) -> dict[str, float]:
    """MLflow metric names ``[<stage>.]<benchmark>.pass_at_<k>`` (logged under the ``eval`` prefix)."""
    prefix = f"{stage}." if stage else ""
    return {f"{prefix}{r['benchmark']}.pass_at_{r['k']}": r["pass_at_k"] for r in summary.iter_rows(named=True)}


def ladder_stages(ladder: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The stages of a ladder in the order they were evaluated: a benchmark scored at only some
    stages (``benchmark_stages``) does not reorder them (the fullest row leads)."""
    rows = sorted(ladder.values(), key=len, reverse=True)   # stable: equal rows keep their order
    return list(dict.fromkeys(s for v in rows for s in v))


def ladder_table(summary: pl.DataFrame, k: int = 1) -> dict[str, dict[str, float]]:
    """benchmark -> stage -> pass@k, stages in the order they were evaluated."""
    rows = summary.filter((pl.col("k") == k) & pl.col("stage").is_not_null())
    out: dict[str, dict[str, float]] = {}
    for r in rows.iter_rows(named=True):
        out.setdefault(r["benchmark"], {})[r["stage"]] = r["pass_at_k"]
    return out


def ladder_order(ladder: dict) -> list[str]:
    """Benchmarks to show: the trained synthetic families, then their mean, then the families no
    stage trains on and their mean, then the public benchmarks."""
    def rank(b: str) -> tuple:
        for i, group in enumerate(HELDOUT_GROUPS):
            if b.startswith(f"{group}/"):
                return (2 * i, b)
            if b == group:
                return (2 * i + 1, b)
        return (2 * len(HELDOUT_GROUPS), b)
    return sorted(ladder, key=rank)


def _families(ladder: dict, group: str) -> list[str]:
    return [b for b in ladder if b.startswith(f"{group}/")] or [b for b in ladder if b == group]


def _stage_mean(ladder: dict, families: list[str], stage: str) -> float:
    values = [ladder[b][stage] for b in families if stage in ladder[b]]
    return sum(values) / len(values) if values else float("nan")


def untrained_falls(ladder: dict, intervals: list | None) -> list:
    """The never-trained families (and their mean) whose pass@1 fell from the first stage to the
    last beyond the paired interval: what training cost on skills it never saw."""
    stages = list(dict.fromkeys(s for b in _families(ladder, UNTRAINED_BENCHMARK) for s in ladder[b]))
    if not intervals or len(stages) < 2:
        return []
    names = set(_families(ladder, UNTRAINED_BENCHMARK)) | {UNTRAINED_BENCHMARK}
    return [iv for iv in intervals if iv.benchmark in names and (iv.a, iv.b) == (stages[0], stages[-1]) and iv.fell]


def ladder_verdict(ladder: dict[str, dict[str, float]], audit_passed: bool | None = None,
                   intervals: list | None = None) -> str | None:
    """One line a user reads first: did training help on held-out families (the mean pass@1 of
    the trained synthetic families, first stage -> last, the last stage over the one before it
    and RL over SFT), each with its paired 95% interval where ``intervals`` (``tasks.heldout_stats``)
    has it and "within noise" when that interval contains 0; whether a family no stage trains on
    fell beyond its interval; and the audit. None when the run evaluated no stage ladder."""
    from tasks.heldout_stats import find_interval

    families = _families(ladder, SYNTHETIC_BENCHMARK)
    stages = list(dict.fromkeys(s for b in families for s in ladder[b]))
    if not families or len(stages) < 2:
        return None

    def mean(stage: str) -> float:
        return _stage_mean(ladder, families, stage)

    def delta(a: str, b: str) -> tuple[str, object]:
        iv = find_interval(intervals or [], SYNTHETIC_BENCHMARK, a, b)
        if iv is None:
            return f"{mean(b) - mean(a):+.2f}", None
        return f"{iv.label()}{' within noise' if iv.within_noise else ''}", iv

    first, last = stages[0], stages[-1]
    text, overall = delta(first, last)
    gain = mean(last) - mean(first)
    if overall is not None and overall.within_noise:
        head = "Training's effect is within noise"
    else:
        head = f"Training {'helped' if gain > 0 else 'did not help'}"
    line = (f"{head}: mean held-out pass@1 over {len(families)} "
            f"famil{'y' if len(families) == 1 else 'ies'} {mean(first):.2f} ({first}) -> {mean(last):.2f} ({last}), "
            f"{text}")
    pairs = [(stages[-2], last)] if len(stages) > 2 else []
    sft, rl = last_of("sft"), last_of("rl")
    if sft in stages and rl in stages and (sft, rl) not in pairs and (sft, rl) != (first, last):
        pairs.append((sft, rl))
    for a, b in pairs:
        line += f"; {b} vs {a} {delta(a, b)[0]}"
    if _families(ladder, UNTRAINED_BENCHMARK) and intervals:
        falls = untrained_falls(ladder, intervals)
        untrained = len([b for b in ladder if b.startswith(f"{UNTRAINED_BENCHMARK}/")]) or 1
        line += ("; never-trained families FELL: " + ", ".join(
            f"{iv.benchmark.split('/', 1)[-1]} {iv.label()} ({iv.a} -> {iv.b})" for iv in falls) if falls else
            f"; no never-trained family ({untrained}) fell beyond its interval")
    if audit_passed is not None:
        line += f"; training-data audit {'passed' if audit_passed else 'FAILED'}"
    return line + "."


def ladder_figure(ladder: dict[str, dict[str, float]], title: str):
    """One small chart per held-out synthetic family and each pooled mean: pass@1 after each
    stage (trained families blue, families no stage trains on orange, means black)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [b for b in ladder_order(ladder) if heldout_group(b) is not None or b in HELDOUT_GROUPS]
    cols = min(4, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax, bench in zip(axes.flat, panels):
        by_stage = ladder[bench]
        untrained = bench == UNTRAINED_BENCHMARK or heldout_group(bench) == UNTRAINED_BENCHMARK
        ax.plot(list(by_stage), list(by_stage.values()), marker="o",
                color="black" if bench in HELDOUT_GROUPS else "tab:orange" if untrained else "tab:blue")
        for x, y in enumerate(by_stage.values()):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        name = ("mean of families" if bench in HELDOUT_GROUPS else bench.split("/", 1)[1])
        ax.set_title(f"{name} (never trained)" if untrained else name, fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0][0].set_ylabel("held-out pass@1")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def pass_at_k_figure(summary: pl.DataFrame, title: str):
    """Grouped bars: one group per benchmark, one bar per k."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = summary.get_column("benchmark").unique(maintain_order=True).to_list()
    ks = sorted(summary.get_column("k").unique().to_list())
    width = 0.8 / max(1, len(ks))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(benches) + 2), 3.8))
    for i, k in enumerate(ks):
        values = [summary.filter((pl.col("benchmark") == b) & (pl.col("k") == k)).get_column("pass_at_k").sum()
                  for b in benches]
        ax.bar([x + i * width for x in range(len(benches))], values, width, label=f"pass@{k}")
    ax.set_xticks([x + width * (len(ks) - 1) / 2 for x in range(len(benches))], benches, rotation=20)
    ax.set_ylim(0, 1)
    ax.set_ylabel("pass@k")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
