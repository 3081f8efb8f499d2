"""Difficulty filter: sample n completions per prompt, verify them, keep a pass-rate band.

M1 kept math problems whose pass rate over 10 samples of a strong reasoning model lies
strictly between 0 and 0.9, bounded synthetic logic tasks by pass rate, and filtered code
by sampled pass rate: problems the model always solves teach nothing, problems it never
solves give no reward signal. Only RL-side rows are sampled (synthetic instances assigned
to SFT never reach RL). The unbiased pass@k is stored beside the rate for reporting.

Writes ``rollouts`` (every sample with its reward), ``difficulty`` (per prompt: n,
correct, pass@k, decision) and ``decisions`` (one row per removed prompt: too_easy or
unsolved). Rows in = rows kept + rows removed.

Incremental per row (``reuse``): each scored row carries a ``row_key``, the digest of what its
decision depends on (the prompt as rendered for the model, the fields its verifier reads, the
model's weights, the sampling, its band and the sandbox limits). A row whose key an earlier run already
decided is not sampled again: this run records that decision again (``reused_from`` names the
run that sampled it, and a removal is a ``decisions`` row of this run too), so adding 10 prompts
to a finished home samples exactly those 10.
"""
from __future__ import annotations

import hashlib
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.model_cache import model_identity
from tasks.passk import pass_at_k
from tasks.rollout.base import RolloutBackend
from tasks.scoring import (
    DifficultySampling,
    ScoredSample,
    VerifySettings,
    render_prompt,
    rollout_rows,
    row_domain,
    row_id,
    score_samples,
)
from tasks.tracking import current_run_id, log_counters, log_figure, log_table, stage_run
from tasks.verify.registry import VERIFIED_FIELDS, VERIFIERS
from warehouse import TableRef, Warehouse

log = logging.getLogger("posttrain.difficulty")
STAGE = "difficulty"


class Band(BaseModel):
    """Keep a prompt when low < pass rate < high (strict, as in M1: 0 < rate < 0.9 over the
    samples). ``k`` only names the unbiased pass@k stored beside the rate for reporting."""

    model_config = ConfigDict(extra="forbid")
    k: int = Field(10, ge=1)
    low: float = Field(0.0, ge=0, le=1)
    high: float = Field(0.9, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> Band:
        if self.low >= self.high:
            raise ValueError(f"band low={self.low} must be below high={self.high}")
        return self

    def decide(self, value: float) -> str:
        if value <= self.low:
            return "unsolved"
        if value >= self.high:
            return "too_easy"
        return "keep"


class DifficultyConfig(VerifySettings):
    # The model whose pass rates band the prompts (M1: a strong reasoning model); an alias
    # ("smol", "tiny-llama"), a path, or "policy": the model the RL stage starts from (the
    # newest pre-RL row of `models`). None: the rollout section's model.
    model: str | None = None
    sampling: DifficultySampling = Field(default_factory=DifficultySampling)
    bands: dict[str, Band] = Field(default_factory=lambda: {
        "math": Band(k=10, low=0.0, high=0.9),
        "logic": Band(k=1, low=0.0, high=0.9),
        "code": Band(k=1, low=0.0, high=0.9),
    })
    max_rows_per_table: int | None = Field(None, ge=1)
    prompts_per_chunk: int = Field(64, ge=1, description="prompts sent to the backend at once")
    reuse: bool = Field(True, description="a row an earlier run decided with the same row_key (prompt, verifier "
                                          "fields, model, sampling, band, sandbox) keeps that decision unsampled")

    @model_validator(mode="after")
    def _enough_samples(self) -> DifficultyConfig:
        for domain, band in self.bands.items():
            if band.k > self.sampling.n:
                raise ValueError(f"band {domain!r} needs pass@{band.k} but sampling.n={self.sampling.n}")
            if domain not in VERIFIERS:
                raise ValueError(f"band for domain {domain!r}, which has no verifier; known: {sorted(VERIFIERS)}")
        return self


# -- small steps ----------------------------------------------------------------------------

def pass_rates(samples: list[ScoredSample], k: int) -> tuple[int, int, float, float]:
    n = len(samples)
    correct = sum(1 for s in samples if s.reward >= 1.0)
    return n, correct, pass_at_k(n, correct, k), pass_at_k(n, correct, 1)


def pass_rate_histogram(difficulty: pl.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    scored = difficulty.filter(pl.col("decision") != "unscored")
    for domain in sorted(scored.get_column("domain").unique().to_list()):
        values = scored.filter(pl.col("domain") == domain).get_column("pass_at_1").to_list()
        ax.hist(values, bins=20, range=(0, 1), alpha=0.6, label=domain)
    ax.set_xlabel("pass rate")
    ax.set_ylabel("prompts")
    ax.set_title("difficulty: pass rate per prompt")
    ax.legend()
    fig.tight_layout()
    return fig


# -- the stage --------------------------------------------------------------------------------

def rl_side(df: pl.DataFrame) -> pl.DataFrame:
    """Only rows that can feed RL: synthetic instances assigned to the SFT side never do."""
    return df.filter(pl.col("split") == "rl") if "split" in df.columns else df


def row_key(row: dict, domain: str, rendered: str, model: str, cfg: DifficultyConfig) -> str:
    """The digest of everything a row's difficulty decision depends on (``model``: its
    ``model_identity``)."""
    parts = {"prompt": rendered, "domain": domain, "fields": {f: row.get(f) for f in VERIFIED_FIELDS},
             "model": model, "sampling": cfg.sampling.model_dump(), "band": cfg.bands[domain].model_dump(),
             "sandbox": [cfg.sandbox_timeout_s, cfg.sandbox_memory_mb]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def decided_rows(wh: Warehouse) -> dict[str, dict]:
    """row_key -> the newest difficulty row that sampled it (reused rows point at theirs)."""
    if not wh.exists("difficulty"):
        return {}
    df = wh.read("difficulty")
    if "row_key" not in df.columns:
        return {}
    return {r["row_key"]: r for r in df.filter(pl.col("row_key").is_not_null()).iter_rows(named=True)}


def _removal(pid: str, table: str, decision: str, pass1: float, run_id: str) -> dict:
    """The ``decisions`` row of a prompt the band removes."""
    return {"row_id": pid, "stage": STAGE, "decision": "removed", "reason": decision,
            "reference_id": f"{table}:pass_rate", "score": pass1, "run_id": run_id}


def _process_table(wh, ref, cfg, backend, params, limits, pool, run_id, decided):
    table = ref.name
    df = rl_side(wh.read(table, ref.snapshot))
    banded = pl.Series([row_domain(r) in cfg.bands for r in df.iter_rows(named=True)], dtype=pl.Boolean)
    to_score, unbanded = df.filter(banded), df.filter(~banded)
    if cfg.max_rows_per_table is not None and to_score.height > cfg.max_rows_per_table:
        # a seeded sample of the rows to score, not the head (tables are ordered by task or
        # source); rows without a band are never sampled away: they pass as unscored, so the
        # open prompts the GenRM rewards reach RL however many verifiable rows are capped
        to_score = to_score.sample(n=cfg.max_rows_per_table, seed=cfg.sampling.seed).sort(df.columns[0])
    rows = unbanded.to_dicts() + to_score.to_dicts()
    scored = [r for r in rows if row_domain(r) in cfg.bands]
    rollouts, difficulty, decisions = [], [], []
    model = getattr(backend, "model_name", backend.name)
    for r in rows:
        if row_domain(r) not in cfg.bands:  # no verifier for it: passed through untouched
            difficulty.append({"prompt_id": row_id(r), "source_table": table, "domain": row_domain(r),
                               "n": 0, "correct": 0, "decision": "unscored", "model": model, "run_id": run_id})
    rendered = {row_id(r): render_prompt(r, row_domain(r), cfg, backend) for r in scored}
    weights = model_identity(model)
    keys = {row_id(r): row_key(r, row_domain(r), rendered[row_id(r)], weights, cfg) for r in scored}
    fresh = []
    for r in scored:
        pid = row_id(r)
        before = decided.get(keys[pid])
        if before is None:
            fresh.append(r)
            continue
        difficulty.append({**before, "source_table": table, "run_id": run_id,
                           "reused_from": before.get("reused_from") or before["run_id"]})
        if before["decision"] != "keep":
            decisions.append(_removal(pid, table, before["decision"], before["pass_at_1"], run_id))
    if len(fresh) < len(scored):
        log.info("difficulty %s: %d of %d prompts decided before with the same key, reused; sampling %d",
                 table, len(scored) - len(fresh), len(scored), len(fresh))
    for start in range(0, len(fresh), cfg.prompts_per_chunk):
        chunk = fresh[start:start + cfg.prompts_per_chunk]
        prompts = [rendered[row_id(r)] for r in chunk]
        outputs = backend.generate(prompts, params)
        for r, completions in zip(chunk, outputs):
            pid, domain, band = row_id(r), row_domain(r), cfg.bands[row_domain(r)]
            samples = score_samples(domain, r, completions, limits, pool)
            n, correct, value, pass1 = pass_rates(samples, band.k)
            decision = band.decide(pass1)   # the rate, not pass@k: pass@k of 3/16 at k=10 is 0.96
            rollouts.extend(rollout_rows(pid, table, domain, samples, params, backend, run_id))
            difficulty.append({
                "prompt_id": pid, "source_table": table, "domain": domain, "n": n, "correct": correct,
                "k": band.k, "pass_at_k": value, "pass_at_1": pass1, "band_low": band.low,
                "band_high": band.high, "truncated": sum(s.completion.truncated for s in samples),
                "decision": decision, "model": model, "run_id": run_id, "row_key": keys[pid],
            })
            if decision != "keep":
                decisions.append(_removal(pid, table, decision, pass1, run_id))
        log.info("difficulty %s: %d/%d prompts sampled and verified", table, start + len(chunk), len(fresh))
    return rollouts, difficulty, decisions


def _frame(rows: list[dict], name: str) -> pl.DataFrame:
    from data_specs import get_spec

    spec = get_spec(name)
    return spec.conform(pl.DataFrame(rows, infer_schema_length=None)) if rows else spec.empty()


def run_difficulty(
    wh: Warehouse,
    cfg: DifficultyConfig,
    backend: RolloutBackend,
    tables: tuple[str, ...] = ("rl_pool", "synthetic_tasks"),
    sources: dict[str, TableRef] | None = None,
) -> dict[str, TableRef]:
    """Sample, verify and band every row of ``tables``, each at its snapshot in ``sources`` (else
    its newest); returns refs of the tables written."""
    params = cfg.sampling.params()
    limits = cfg.sandbox_limits()
    inputs = [ref for ref in (wh.pinned(t, sources) for t in tables) if ref is not None]
    with stage_run(STAGE, params={"difficulty": cfg.model_dump(), "backend": backend.name,
                                    "model": getattr(backend, "model_name", backend.name)}) as mlflow_run:
        run_id = mlflow_run or current_run_id() or uuid.uuid4().hex
        for ref in inputs:
            log_table(ref, context="input")
        all_rollouts, all_difficulty, all_decisions = [], [], []
        decided = decided_rows(wh) if cfg.reuse else {}
        with ThreadPoolExecutor(max_workers=cfg.verify_workers) as pool:
            for ref in inputs:
                r, d, x = _process_table(wh, ref, cfg, backend, params, limits, pool, run_id, decided)
                all_rollouts += r
                all_difficulty += d
                all_decisions += x
        refs = {
            "rollouts": wh.append("rollouts", _frame(all_rollouts, "rollouts"), parents=inputs),
            "difficulty": wh.append("difficulty", _frame(all_difficulty, "difficulty"), parents=inputs),
            "decisions": wh.append("decisions", _frame(all_decisions, "decisions"), parents=inputs),
        }
        for ref in refs.values():
            log_table(ref, context="output")
        difficulty_df = _frame(all_difficulty, "difficulty")
        counts = difficulty_df.group_by("decision").len()
        log_counters({row["decision"]: row["len"] for row in counts.to_dicts()}
                     | {"rows_in": len(all_difficulty), "rollouts": len(all_rollouts),
                        "reused": sum(1 for x in all_difficulty if x.get("reused_from")),
                        "truncated": sum(1 for x in all_rollouts if x["truncated"])}, prefix=STAGE)
        if difficulty_df.height:
            log_figure(pass_rate_histogram(difficulty_df), "plots/difficulty_pass_rates.png")
    return refs


def kept_prompt_ids(wh: Warehouse, run_id: str | None = None) -> pl.DataFrame:
    """Prompts the latest (or given) difficulty run kept: what the next stages consume."""
    df = wh.read("difficulty")
    if run_id is None and df.height:
        run_id = df.get_column("run_id").tail(1).item()
    return df.filter((pl.col("run_id") == run_id) & pl.col("decision").is_in(["keep", "unscored"]))


__all__ = [
    "Band",
    "DifficultyConfig",
    "DifficultySampling",
    "kept_prompt_ids",
    "pass_rate_histogram",
    "run_difficulty",
]
