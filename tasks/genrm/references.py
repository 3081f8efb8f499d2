"""Reference selection: candidate answers -> GenRM pairwise judge -> Swiss rounds -> best answer.

For every open prompt, candidates come from the configured sources (the prompt's stored
solution/answer, completions of one or more rollout backends). All prompts' tournaments
advance in lockstep, so each Swiss round is one batched judge call. Every raw judge output
goes to ``judgments``, every game and bye to ``swiss_matches``, the final standings to
``tournaments`` and the winners to ``references``.

Incremental per row (``reuse``): each reference carries a ``row_key``, the digest of what it
depends on (the prompt, its stored candidate texts and constraints, the candidate sources with
their models' identities, the judge's model identity and settings, the Swiss settings and the
seed). A prompt whose current reference has the key this run would give it keeps that
reference: only new or changed prompts are sampled and played (``ReferencesReport.reused``).
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import polars as pl

from data_specs import get_spec
from tasks.genrm.config import CandidateSource, PromptSelection, ReferencesConfig
from tasks.genrm.consistency import JudgeSample, PairDecision
from tasks.genrm.judge import Constraints, GenRMJudge, PairRequest, constraints_from_metadata
from tasks.genrm.models import resolve_rollout
from tasks.genrm.swiss import Pairing, Standing, SwissTournament, buchholz
from tasks.model_cache import model_identity
from tasks.rollout.base import RolloutBackend
from tasks.rollout.chat import render_prompt
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import engine_key, make_backend
from tasks.text import collapse_text, stable_id
from warehouse import TableRef, Warehouse

log = logging.getLogger("posttrain.references")
USER_TABLE = "user"


class PairJudge(Protocol):
    model_name: str

    def compare(self, requests: list[PairRequest]) -> list[PairDecision]: ...


@dataclass
class OpenPrompt:
    prompt_id: str
    source_table: str
    domain: str
    prompt: str
    row: dict = field(default_factory=dict)
    constraints: Constraints | None = None


@dataclass(frozen=True)
class Candidate:
    candidate_id: str
    source: str
    text: str


@dataclass
class ReferencesReport:
    prompts: int = 0
    candidates: int = 0
    references: int = 0
    reused: int = 0          # prompts whose earlier reference had this run's row_key: not played again
    no_candidates: int = 0
    duplicate_candidates: int = 0
    empty_candidates: int = 0
    bad_constraints: int = 0
    games: int = 0
    byes: int = 0
    status_counts: Counter = field(default_factory=Counter)
    parse_counts: Counter = field(default_factory=Counter)
    refs: dict[str, TableRef] = field(default_factory=dict)
    inputs: list[TableRef] = field(default_factory=list)   # the prompt tables read

    def as_counters(self) -> dict[str, float]:
        samples = sum(self.parse_counts.values())
        out = {k: float(getattr(self, k)) for k in ("prompts", "candidates", "references", "reused", "no_candidates",
                                                     "duplicate_candidates", "empty_candidates", "bad_constraints",
                                                     "games", "byes")}
        out["judge_samples"] = float(samples)
        out["unparseable_share"] = (self.parse_counts["unparseable"] + self.parse_counts["out_of_range"]) / samples \
            if samples else 0.0
        out.update({f"games_{k}": float(v) for k, v in self.status_counts.items()})
        return out


# -- backends ------------------------------------------------------------------------------

def build_backends(cfg: ReferencesConfig, home: str | None = None, sources: Mapping[str, TableRef] | None = None
                   ) -> tuple[RolloutBackend, dict[str, RolloutBackend]]:
    """The judge backend and one backend per 'backend' candidate source.

    Model names resolve against ``home`` first (``tasks.genrm.models``), as of the ``models``
    snapshot handed over in ``sources``: ``policy`` is the model RL starts from. Sources whose
    model settings equal the judge's (or each other's) share one loaded model: sampling settings
    are per call, so only the engine part must match.
    """
    loaded: dict[str, RolloutBackend] = {}

    def engine(rollout: RolloutConfig) -> RolloutBackend:
        rollout = resolve_rollout(rollout, home, sources)
        key = engine_key(rollout)
        if key not in loaded:
            loaded[key] = make_backend(rollout)
        return loaded[key]

    judge = engine(cfg.judge.rollout)
    sources = {s.name: engine(s.rollout) for s in cfg.candidates if s.kind == "backend" and s.rollout is not None}
    return judge, sources


def as_judge(judge_or_backend: Any, cfg: ReferencesConfig) -> PairJudge:
    if hasattr(judge_or_backend, "compare"):
        return judge_or_backend
    return GenRMJudge(judge_or_backend, cfg.judge, seed=cfg.seed)


# -- prompts -------------------------------------------------------------------------------

def _row_prompt(row: dict, table: str, report: ReferencesReport) -> OpenPrompt:
    try:
        constraints = constraints_from_metadata(row.get("metadata"))
    except ValueError as e:
        report.bad_constraints += 1
        log.warning("%s row %s: ignoring rule constraints: %s", table, row.get("id"), e)
        constraints = None
    return OpenPrompt(str(row["id"]), table, str(row.get("domain") or "general"), str(row["prompt"]), row, constraints)


def _user_prompt(item: str | dict, report: ReferencesReport) -> OpenPrompt:
    row = {"prompt": item} if isinstance(item, str) else dict(item)
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise ValueError(f"user prompt {str(item)[:80]!r} has no non-empty 'prompt' text")
    if "constraints" in row and "metadata" not in row:
        row["metadata"] = json.dumps({"constraints": row.pop("constraints")})
    row.setdefault("id", stable_id(USER_TABLE, collapse_text(row["prompt"])))
    row.setdefault("domain", "general")
    return _row_prompt(row, USER_TABLE, report)


def select_open_prompts(wh: Warehouse, selection: PromptSelection, extra: Sequence[str | dict] | None,
                        report: ReferencesReport, sources: dict[str, TableRef] | None = None) -> list[OpenPrompt]:
    """Rows of the first table in ``selection.tables`` with open-domain rows (at its snapshot in
    ``sources``, else its newest), plus ``extra``."""
    chosen: list[OpenPrompt] = []
    for table in selection.tables:
        ref = wh.pinned(table, sources)
        if ref is None:
            continue
        df = wh.read(table, ref.snapshot)
        if not {"id", "prompt", "domain"} <= set(df.columns):
            log.warning("table %s lacks id/prompt/domain columns; skipped", table)
            continue
        rows = df.filter(pl.col("domain").is_in(selection.domains)).sort("id")
        if rows.height:
            if selection.max_prompts is not None:
                rows = rows.head(selection.max_prompts)
            chosen = [_row_prompt(r, table, report) for r in rows.iter_rows(named=True)]
            report.inputs = [ref]
            break
    seen = {p.prompt_id for p in chosen}
    for item in extra or []:
        p = _user_prompt(item, report)
        if p.prompt_id not in seen:
            chosen.append(p)
            seen.add(p.prompt_id)
    return chosen


# -- candidates ----------------------------------------------------------------------------

def _stored_text(row: dict, source: CandidateSource) -> str | None:
    for name in source.fields:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    return None


def gather_candidates(prompts: list[OpenPrompt], sources: list[CandidateSource],
                      backends: dict[str, RolloutBackend], seed: int,
                      report: ReferencesReport) -> dict[str, list[Candidate]]:
    """Candidates per prompt, in source order (that order is the Swiss seed order).

    Empty texts are dropped and exact duplicates (after whitespace normalization) are kept
    once, under the earliest source.
    """
    raw: dict[str, list[Candidate]] = {p.prompt_id: [] for p in prompts}
    for s_index, source in enumerate(sources):
        if source.kind == "stored":
            for p in prompts:
                text = _stored_text(p.row, source)
                if text is not None:
                    raw[p.prompt_id].append(Candidate(f"{source.name}:0", source.name, text))
            continue
        backend = backends.get(source.name)
        if backend is None:
            raise ValueError(f"candidate source {source.name!r} has no backend")
        rendered = [render_prompt(backend.format_chat, p.prompt, p.domain) for p in prompts]
        params = source.rollout.sampling_params(seed=seed + 7919 * (s_index + 1))
        for p, completions in zip(prompts, backend.generate(rendered, params)):
            raw[p.prompt_id].extend(Candidate(f"{source.name}:{i}", source.name, c.text)
                                    for i, c in enumerate(completions))
    out: dict[str, list[Candidate]] = {}
    for pid, cands in raw.items():
        seen: set[str] = set()
        kept = []
        for c in cands:
            key = collapse_text(c.text)
            if not key:
                report.empty_candidates += 1
            elif key in seen:
                report.duplicate_candidates += 1
            else:
                seen.add(key)
                kept.append(c)
        out[pid] = kept
    return out


# -- tournaments ---------------------------------------------------------------------------

def decided_by(ranking: list[Standing]) -> str:
    """The first ranking key that separates the winner from the runner-up."""
    if len(ranking) < 2:
        return "single_candidate"
    tie_break = buchholz(ranking)
    first, second = ranking[0], ranking[1]
    if first.points != second.points:
        return "points"
    if tie_break[first.candidate] != tie_break[second.candidate]:
        return "buchholz"
    if first.wins != second.wins:
        return "wins"
    return "seed"


@dataclass
class _Played:
    tournaments: dict[str, SwissTournament]
    decisions: dict[tuple[str, int, str, str], PairDecision]


def play_tournaments(prompts: list[OpenPrompt], candidates: dict[str, list[Candidate]], judge: PairJudge,
                     cfg: ReferencesConfig, report: ReferencesReport) -> _Played:
    """All tournaments round by round; each round's games across prompts form one judge batch."""
    by_id = {p.prompt_id: p for p in prompts}
    texts = {(pid, c.candidate_id): c.text for pid, cands in candidates.items() for c in cands}
    tournaments = {pid: SwissTournament([c.candidate_id for c in cands], cfg.swiss.rounds, cfg.swiss.win_points,
                                        cfg.swiss.tie_points, cfg.swiss.bye_points)
                   for pid, cands in candidates.items() if cands}
    decisions: dict[tuple[str, int, str, str], PairDecision] = {}
    round_number = 0
    while not all(t.finished for t in tournaments.values()):
        round_number += 1
        games: list[tuple[str, Pairing]] = [(pid, g) for pid, t in tournaments.items() for g in t.next_round()]
        requests = [PairRequest(by_id[pid].prompt, texts[(pid, g.first)], texts[(pid, g.second)],
                                by_id[pid].constraints) for pid, g in games]
        log.info("swiss round %d: %d games across %d prompts", round_number, len(games), len(tournaments))
        for (pid, game), decision in zip(games, judge.compare(requests) if requests else [], strict=True):
            tournaments[pid].record(game, decision.verdict, decision.status)
            decisions[(pid, game.round, game.first, game.second)] = decision
            report.status_counts[decision.status] += 1
            report.parse_counts.update(s.parsed.status for s in decision.samples)
    report.games = len(decisions)
    report.byes = sum(1 for t in tournaments.values() for m in t.matches if m.status == "bye")
    return _Played(tournaments, decisions)


# -- rows ----------------------------------------------------------------------------------

def _frame(name: str, rows: list[dict]) -> pl.DataFrame:
    spec = get_spec(name)
    return spec.conform(pl.DataFrame(rows, schema=spec.schema)) if rows else spec.empty()


def judgment_rows(samples: list[JudgeSample], *, run_id: str | None, context: str, kind: str, prompt_id: str,
                  match_id: str | None, first_id: str | None, second_id: str | None, judge_model: str) -> list[dict]:
    rows = []
    for s in samples:
        shown_first, shown_second = (second_id, first_id) if s.order == "backward" else (first_id, second_id)
        rows.append({
            "judgment_id": stable_id(run_id, context, prompt_id, match_id, s.order, str(s.attempt),
                                     str(s.sample_index), first_id, second_id),
            "run_id": run_id, "context": context, "kind": kind, "prompt_id": prompt_id, "match_id": match_id,
            "order": s.order, "attempt": s.attempt, "sample_index": s.sample_index,
            "first_id": shown_first, "second_id": shown_second, "raw_text": s.text,
            "verdict": s.parsed.value, "parse_status": s.parsed.status, "judge_model": judge_model,
        })
    return rows


def _match_id(run_id: str | None, pid: str, round_number: int, first: str, second: str | None) -> str:
    return stable_id(run_id, pid, str(round_number), first, second)


def tournament_rows(played: _Played, prompts: list[OpenPrompt], candidates: dict[str, list[Candidate]],
                    judge_model: str, run_id: str | None, keys: Mapping[str, str] | None = None
                    ) -> dict[str, list[dict]]:
    by_id = {p.prompt_id: p for p in prompts}
    out: dict[str, list[dict]] = {"judgments": [], "swiss_matches": [], "tournaments": [], "references": []}
    for pid, t in played.tournaments.items():
        cands = {c.candidate_id: c for c in candidates[pid]}
        for m in t.matches:
            mid = _match_id(run_id, pid, m.round, m.first, m.second)
            d = played.decisions.get((pid, m.round, m.first, m.second)) if m.second is not None else None
            out["swiss_matches"].append({
                "match_id": mid, "run_id": run_id, "prompt_id": pid, "round": m.round, "first_id": m.first,
                "second_id": m.second, "verdict": m.verdict, "status": m.status,
                "agreement": d.agreement if d else None, "attempts": d.attempts if d else None,
                "points_first": m.points_first, "points_second": m.points_second,
                "judge_model": judge_model if d else None})
            if d is not None:
                out["judgments"] += judgment_rows(d.samples, run_id=run_id, context="swiss", kind="pairwise",
                                                  prompt_id=pid, match_id=mid, first_id=m.first, second_id=m.second,
                                                  judge_model=judge_model)
        ranking = t.ranking()
        tie_break = buchholz(ranking)
        for rank, s in enumerate(ranking, start=1):
            out["tournaments"].append({
                "run_id": run_id, "prompt_id": pid, "candidate_id": s.candidate,
                "candidate_source": cands[s.candidate].source, "seed": s.seed, "text": cands[s.candidate].text,
                "points": s.points, "buchholz": tie_break[s.candidate], "wins": s.wins, "byes": s.byes,
                "rank": rank, "rounds_planned": t.rounds_planned, "rounds_played": t.rounds_played,
                "stopped_early": t.stopped_early})
        best = ranking[0]
        prompt = by_id[pid]
        out["references"].append({
            "prompt_id": pid, "run_id": run_id, "source_table": prompt.source_table, "domain": prompt.domain,
            "prompt": prompt.prompt, "reference": cands[best.candidate].text, "candidate_id": best.candidate,
            "candidate_source": cands[best.candidate].source, "points": best.points,
            "buchholz": tie_break[best.candidate], "n_candidates": len(ranking), "rounds_played": t.rounds_played,
            "decided_by": decided_by(ranking), "judge_model": judge_model, "row_key": (keys or {}).get(pid)})
    return out


def _backend_model(backend: Any, fallback: str | None) -> str:
    return model_identity(str(getattr(backend, "model_name", None) or fallback or getattr(backend, "name", "")))


def reference_keys(prompts: list[OpenPrompt], cfg: ReferencesConfig, judge: PairJudge,
                   backends: Mapping[str, RolloutBackend]) -> dict[str, str]:
    """prompt_id -> the digest of everything its reference depends on."""
    sources = [{**s.model_dump(), "model": _backend_model(backends.get(s.name), s.rollout.model if s.rollout else None)}
               if s.kind == "backend" else s.model_dump() for s in cfg.candidates]
    judge_part = {"model": model_identity(judge.model_name), "settings": getattr(judge, "cfg", cfg.judge).model_dump()}
    shared = {"sources": sources, "judge": judge_part, "swiss": cfg.swiss.model_dump(), "seed": cfg.seed}
    out = {}
    for p in prompts:
        stored = {s.name: _stored_text(p.row, s) for s in cfg.candidates if s.kind == "stored"}
        parts = {"prompt": p.prompt, "domain": p.domain, "table": p.source_table, "stored": stored,
                 "constraints": p.constraints.model_dump() if p.constraints else None, **shared}
        out[p.prompt_id] = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return out


def reusable_references(wh: Warehouse, keys: Mapping[str, str]) -> set[str]:
    """The prompts whose current reference was chosen with the key this run gives them."""
    if not wh.exists("references"):
        return set()
    current = current_references(wh)
    if "row_key" not in current.columns:
        return set()
    return {r["prompt_id"] for r in current.select("prompt_id", "row_key").iter_rows(named=True)
            if r["row_key"] is not None and keys.get(r["prompt_id"]) == r["row_key"]}


def run_references(wh: Warehouse, cfg: ReferencesConfig, judge_backend: Any,
                   candidate_backends: dict[str, RolloutBackend] | None = None,
                   prompts: Sequence[str | dict] | None = None, run_id: str | None = None,
                   sources: dict[str, TableRef] | None = None) -> ReferencesReport:
    """Pick and store a reference answer per open prompt (from the prompt tables' snapshots in
    ``sources``, else their newest).

    ``judge_backend``: a RolloutBackend (wrapped in a GenRMJudge) or any object with a
    ``compare(list[PairRequest]) -> list[PairDecision]`` method.
    """
    report = ReferencesReport()
    judge = as_judge(judge_backend, cfg)
    open_prompts = select_open_prompts(wh, cfg.prompts, prompts, report, sources)
    report.prompts = len(open_prompts)
    if not open_prompts:
        log.warning("references: no open prompts in %s (domains %s) and none passed",
                    cfg.prompts.tables, cfg.prompts.domains)
        return report
    keys = reference_keys(open_prompts, cfg, judge, candidate_backends or {})
    reused = reusable_references(wh, keys) if cfg.reuse else set()
    report.reused = len(reused)
    if reused:
        log.info("references: %d of %d prompts keep the reference an earlier run chose with the same key; "
                 "playing %d", len(reused), len(open_prompts), len(open_prompts) - len(reused))
    open_prompts = [p for p in open_prompts if p.prompt_id not in reused]
    candidates = gather_candidates(open_prompts, cfg.candidates, candidate_backends or {}, cfg.seed, report) \
        if open_prompts else {}
    report.candidates = sum(len(c) for c in candidates.values())
    report.no_candidates = sum(1 for c in candidates.values() if not c)
    played = play_tournaments(open_prompts, candidates, judge, cfg, report)
    rows = tournament_rows(played, open_prompts, candidates, judge.model_name, run_id, keys)
    for name in ("judgments", "swiss_matches", "tournaments", "references"):
        report.refs[name] = wh.append(name, _frame(name, rows[name]), parents=report.inputs)
    report.references = len(rows["references"])
    return report


def current_references(wh: Warehouse, snapshot: str | None = None) -> pl.DataFrame:
    """The latest reference per prompt (``references`` is appended to by every run), as of
    ``snapshot`` (default: the newest)."""
    df = (wh.read("references", snapshot) if snapshot else wh.read("references", default_empty=True)) \
        .with_row_index("_order")
    return df.group_by("prompt_id", maintain_order=True).agg(pl.all().sort_by("_order").last()) \
        .drop("_order").sort("prompt_id")
