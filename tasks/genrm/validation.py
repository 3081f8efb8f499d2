"""GenRM validation: accuracy on a labelled judge benchmark and the Best-of-N vs pass@N gap.

The benchmark is built from verifiable data where the right label is known: a math prompt
with its gold answer yields a correct response and a perturbed wrong one (the wrong final
answer is checked with math-verify to really differ), as one pairwise item (order drawn at
random, so position bias cannot score) and two grade items. Users add labelled files:

  pairwise rows: prompt, first (or response_a / reference), second (or response_b / response),
                 label: -1 / 0 / 1 (Answer 2 vs Answer 1) or "first" / "tie" / "second";
                 optional dimension: the judge dimension the label is about (correctness,
                 truthfulness, helpfulness, harmlessness, or any a profile names)
  grade rows:    prompt, ground_truth (or answer), response, label: 1 / 0 (or true/false,
                 "correct"/"wrong")

Bad rows go to ``quarantine`` with file, line, field and reason. The BoN check samples N
answers per math prompt, lets the GenRM pick the best by its five-grade reward and compares
how often that pick is right (BoN) with how often any of the N is right (pass@N).
"""
from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from data_specs import get_spec
from tasks.genrm.config import ReferencesConfig
from tasks.genrm.consistency import BACKWARD
from tasks.genrm.judge import GenRMJudge, GradeRequest, PairRequest
from tasks.genrm.references import judgment_rows
from tasks.passk import pass_at_k
from tasks.records import RawRecord, expand_paths, read_records
from tasks.rollout.base import RolloutBackend
from tasks.rollout.chat import render_prompt
from tasks.text import stable_id
from tasks.verify.math import MathVerifyTimeout, math_equal
from tasks.verify.registry import verify_with_error
from warehouse import TableRef, Warehouse

log = logging.getLogger("posttrain.genrm.validation")
ORIGIN_MATH = "math_perturbed"
ORIGIN_SYNTHETIC = "synthetic"  # items' origin is "synthetic:<task>"
# what the built items' labels are about: a gold answer against a wrong one differs in correctness
CONSTRUCTED_DIMENSION = "correctness"
_DIMENSION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_PAIR_FIELDS = {"first": ("first", "response_a", "reference", "chosen_first"),
                "second": ("second", "response_b", "response", "candidate")}
_LABEL_WORDS = {"first": -1, "a": -1, "tie": 0, "similar": 0, "second": 1, "b": 1,
                "correct": 1, "true": 1, "yes": 1, "wrong": 0, "incorrect": 0, "false": 0, "no": 0}


# -- building the benchmark ----------------------------------------------------------------

def perturb_answer(gold: str, rng: random.Random) -> str | None:
    """A nearby wrong answer: shift the last number in the gold answer, or None if that fails."""
    matches = list(_NUMBER.finditer(gold))
    if matches:
        m = matches[-1]
        number = float(m.group()) if "." in m.group() else int(m.group())
        shifted = number + rng.choice([1, 2, 3, -1, -2, 10])
        wrong = gold[:m.start()] + (f"{shifted:g}" if isinstance(shifted, float) else str(shifted)) + gold[m.end():]
    else:
        wrong = f"{gold} + 1"
    try:
        return None if math_equal(gold, wrong) else wrong
    except MathVerifyTimeout:   # an equivalence math-verify cannot settle is no usable wrong answer
        return None


def boxed_response(answer: str) -> str:
    return f"Working through the problem step by step gives the result.\nThe final answer is \\boxed{{{answer}}}."


def math_benchmark_items(prompts: pl.DataFrame, n_items: int, seed: int) -> list[dict]:
    """Pairwise and grade items from math prompts with gold answers."""
    rng = random.Random(seed)
    rows = prompts.filter((pl.col("domain") == "math") & pl.col("answer").is_not_null()).sort("id")
    items = []
    for row in rows.iter_rows(named=True):
        if len(items) >= 3 * n_items:
            break
        gold = str(row["answer"]).strip()
        wrong = perturb_answer(gold, rng) if gold else None
        if wrong is None:
            continue
        right, bad = boxed_response(gold), boxed_response(wrong)
        correct_second = rng.random() < 0.5
        first, second = (bad, right) if correct_second else (right, bad)
        base = {"origin": ORIGIN_MATH, "prompt": row["prompt"], "source_id": row["id"], "file": None, "line": None}
        items.append({**base, "item_id": stable_id(ORIGIN_MATH, row["id"], "pair"), "kind": "pairwise",
                      "ground_truth": gold, "first": first, "second": second, "label": 1 if correct_second else -1,
                      "dimension": CONSTRUCTED_DIMENSION})
        for tag, response, label in (("right", right, 1), ("wrong", bad, 0)):
            items.append({**base, "item_id": stable_id(ORIGIN_MATH, row["id"], tag), "kind": "grade",
                          "ground_truth": gold, "first": None, "second": response, "label": label})
    return items


def synthetic_benchmark_items(tasks: Sequence[str], per_task: int, levels: Sequence[int], seed: int,
                              training_ids: set[str] = frozenset(), max_draws: int = 4,
                              kinds: Sequence[str] = ("pairwise",)) -> list[dict]:
    """Items from held-out synthetic instances, ``per_task`` of each kind per task.

    - pairwise: gold vs a verifier-rejected perturbation, the gold's slot alternating;
    - grade: the gold (label 1) or a rejected perturbation (label 0) against the ground
      truth, alternating.

    Instances come from the reserved negative seed range (``tasks.synth.base.heldout_seed``)
    and any instance whose id is a training instance is skipped, so the judge is measured
    on items it never trained on. Labels are balanced within a task and kind: a judge that
    always answers one position or one grade scores exactly chance.
    """
    from tasks.synth.base import heldout_seed
    from tasks.synth.registry import get_task

    items = []
    for name in tasks:
        task = get_task(name)
        origin = f"{ORIGIN_SYNTHETIC}:{name}"
        for kind in kinds:
            # pairwise keeps its original stream name, so adding grade items leaves the pairs as they were
            rng = random.Random(f"judge-benchmark:{seed}:{name}" + ("" if kind == "pairwise" else f":{kind}"))
            seen: set[str] = set()
            made, draw = 0, 0
            while made < per_task and draw < per_task * max_draws:
                level = levels[draw % len(levels)]
                if not 0 <= level < task.n_levels:
                    raise ValueError(f"validation.synthetic_levels: level {level} outside 0..{task.n_levels - 1} "
                                     f"for task {name!r}")
                instance = task.generate(heldout_seed(draw), level)
                draw += 1
                if instance.id in training_ids or instance.id in seen:
                    continue
                seen.add(instance.id)
                item = _synthetic_item(task, instance, kind, made % 2 == 1, rng)
                if item is None:
                    continue
                items.append({**item, "item_id": stable_id(origin, instance.id, kind if kind != "pairwise" else "pair"),
                              "origin": origin, "kind": kind, "source_id": instance.id, "file": None, "line": None})
                made += 1
    return items


def _synthetic_item(task, instance, kind: str, flip: bool, rng: random.Random) -> dict | None:
    """The item's content; ``flip``: gold second (pairwise) or the perturbation shown (grade)."""
    from tasks.genrm.synthetic import judge_grade, judge_pair

    if kind == "pairwise":
        pair = judge_pair(task, instance, gold_second=flip, rng=rng)
        return None if pair is None else {"prompt": pair.question, "ground_truth": pair.gold, "first": pair.first,
                                          "second": pair.second, "label": pair.label,
                                          "dimension": CONSTRUCTED_DIMENSION}
    if kind == "grade":
        grade = judge_grade(task, instance, consistent=not flip, rng=rng)
        return None if grade is None else {"prompt": grade.question, "ground_truth": grade.ground_truth,
                                           "first": None, "second": grade.response, "label": grade.label}
    raise ValueError(f"validation.synthetic_kinds: unknown kind {kind!r} (pairwise, grade)")


def _first_field(data: dict, names: Sequence[str]) -> tuple[str | None, Any]:
    for name in names:
        if data.get(name) is not None:
            return name, data[name]
    return None, None


def _label(value: Any, kind: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and float(value).is_integer():
        label = int(value)
    elif isinstance(value, str) and value.strip().lower() in _LABEL_WORDS:
        label = _LABEL_WORDS[value.strip().lower()]
    elif isinstance(value, str) and re.fullmatch(r"[+-]?\d", value.strip()):
        label = int(value.strip())
    else:
        raise ValueError(f"label {value!r} is not a recognised label")
    allowed = (-1, 0, 1) if kind == "pairwise" else (0, 1)
    if label not in allowed:
        raise ValueError(f"{kind} label must be one of {allowed}, got {label}")
    return label


class _RowError(ValueError):
    def __init__(self, field_name: str, reason: str):
        super().__init__(reason)
        self.field = field_name


def labelled_item(rec: RawRecord, origin: str) -> dict:
    """One user benchmark row, or _RowError naming the field at fault."""
    data = rec.data or {}
    _, prompt = _first_field(data, ("prompt", "question", "instruction"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise _RowError("prompt", "missing_required_field")
    f_name, first = _first_field(data, _PAIR_FIELDS["first"])
    s_name, second = _first_field(data, _PAIR_FIELDS["second"])
    _, truth = _first_field(data, ("ground_truth", "answer", "gold"))
    kind = "grade" if truth is not None and first is None else "pairwise"
    if "label" not in data or data["label"] is None:
        raise _RowError("label", "missing_required_field")
    try:
        label = _label(data["label"], kind)
    except ValueError as e:
        raise _RowError("label", f"bad_label: {e}") from None
    if second is None or not str(second).strip():
        raise _RowError(s_name or "second", "missing_required_field")
    if kind == "pairwise" and (first is None or not str(first).strip()):
        raise _RowError(f_name or "first", "missing_required_field")
    dimension = data.get("dimension")
    if dimension is not None and (kind != "pairwise" or not isinstance(dimension, str)
                                  or not _DIMENSION_NAME.match(dimension.strip().lower())):
        raise _RowError("dimension", "bad_dimension: a pairwise row's dimension is a lowercase name like "
                                     f"'correctness', got {dimension!r}" + ("" if kind == "pairwise" else
                                                                            " on a grade row"))
    return {"item_id": stable_id(origin, str(rec.line), prompt, str(first), str(second)), "origin": origin,
            "kind": kind, "prompt": prompt, "ground_truth": None if truth is None else str(truth),
            "first": None if first is None else str(first), "second": str(second), "label": label,
            "dimension": dimension.strip().lower() if dimension else None,
            "source_id": None, "file": rec.file, "line": rec.line}


def labelled_file_items(paths: Sequence[str | Path], run_id: str | None) -> tuple[list[dict], list[dict]]:
    """(benchmark items, quarantine rows) from user label files; one bad row never stops a file."""
    items, bad = [], []
    for path in expand_paths(paths):
        origin = re.sub(r"[^a-z0-9_]+", "_", Path(path).stem.lower()).strip("_") or "labelled"
        for rec in read_records(path):
            reason, field_name = rec.reason, rec.field
            if reason is None:
                try:
                    items.append(labelled_item(rec, origin))
                    continue
                except _RowError as e:
                    reason, field_name = str(e), e.field
            bad.append({"source": f"judge_benchmark:{origin}", "file": rec.file, "line": rec.line,
                        "field": field_name, "reason": reason, "raw": rec.raw[:2000], "run_id": run_id})
    return items, bad


def build_judge_benchmark(wh: Warehouse, cfg: ReferencesConfig, labelled_files: Sequence[str] = (),
                          run_id: str | None = None, sources: Mapping[str, TableRef] | None = None
                          ) -> tuple[TableRef, int]:
    """Write ``judge_benchmark`` (replace): math-derived items plus user-labelled files.
    ``prompts`` and ``synthetic_tasks`` are read at the snapshots handed in ``sources`` (the
    pipeline's), else at their newest; the snapshot read is the one recorded as a parent."""
    spec = get_spec("judge_benchmark")
    items = []
    parents = []
    prompts = wh.pinned("prompts", sources)
    if prompts is not None and cfg.validation.math_items:
        items += math_benchmark_items(wh.read_ref(prompts), cfg.validation.math_items, cfg.validation.seed)
        parents.append(prompts)
    v = cfg.validation
    if v.synthetic_tasks and v.synthetic_items:
        training_ids: set[str] = set()
        tasks_ref = wh.pinned("synthetic_tasks", sources)
        if tasks_ref is not None:
            training_ids = set(wh.read_ref(tasks_ref)["id"].cast(pl.Utf8).to_list())
            parents.append(tasks_ref)
        items += synthetic_benchmark_items(v.synthetic_tasks, v.synthetic_items, v.synthetic_levels, v.seed,
                                           training_ids, v.synthetic_max_draws, v.synthetic_kinds)
    user_items, bad = labelled_file_items(list(cfg.validation.labelled_files) + list(labelled_files), run_id)
    items += user_items
    if bad:
        wh.append("quarantine", pl.DataFrame(bad, schema=get_spec("quarantine").schema))
        log.warning("judge benchmark: %d labelled row(s) quarantined", len(bad))
    df = spec.conform(pl.DataFrame(items, schema=spec.schema)) if items else spec.empty()
    return wh.write("judge_benchmark", df.unique("item_id", keep="first", maintain_order=True),
                    parents=parents), len(bad)


# -- scoring the judge ---------------------------------------------------------------------

@dataclass
class ValidationResult:
    metrics: dict[str, float] = field(default_factory=dict)
    judgments: list[dict] = field(default_factory=list)


def judge_accuracy(judge: GenRMJudge, benchmark: pl.DataFrame, run_id: str | None) -> ValidationResult:
    """Pairwise accuracy (verdict == label) and grade accuracy ((reward >= 0.5) == label).

    An unreadable verdict counts as wrong: a judge that cannot answer is not accurate.
    """
    result = ValidationResult()
    pairs = benchmark.filter(pl.col("kind") == "pairwise").to_dicts()
    grades = benchmark.filter(pl.col("kind") == "grade").to_dicts()
    if pairs:
        decisions = judge.compare([PairRequest(r["prompt"], r["first"], r["second"]) for r in pairs])
        hits = [judged_verdict(d, r.get("dimension")) == r["label"] for r, d in zip(pairs, decisions)]
        result.metrics["pairwise_accuracy"] = sum(hits) / len(hits)
        result.metrics.update(dimension_metrics(judge, pairs, decisions))
        result.metrics["pairwise_unreadable"] = sum(d.verdict is None for d in decisions) / len(decisions)
        result.metrics["pairwise_items"] = float(len(pairs))
        result.metrics.update(pairwise_sample_metrics(pairs, decisions, "pairwise"))
        for name, items, decided in synthetic_groups(pairs, decisions):
            result.metrics.update(pairwise_sample_metrics(items, decided, name))
        for r, d in zip(pairs, decisions):
            result.judgments += judgment_rows(d.samples, run_id=run_id, context="benchmark", kind="pairwise",
                                              prompt_id=r["item_id"], match_id=None, first_id="first",
                                              second_id="second", judge_model=judge.model_name)
    if grades:
        decisions = judge.grade([GradeRequest(r["prompt"], r["ground_truth"] or "", r["second"]) for r in grades])
        result.metrics.update(grade_metrics(grades, decisions, ""))
        for name, items, decided in synthetic_groups(grades, decisions):
            result.metrics.update(grade_metrics(items, decided, name + "_"))
        for r, d in zip(grades, decisions):
            result.judgments += judgment_rows(d.samples, run_id=run_id, context="benchmark", kind="grade",
                                              prompt_id=r["item_id"], match_id=None, first_id="response",
                                              second_id=None, judge_model=judge.model_name)
    scored = [result.metrics.get("pairwise_accuracy"), result.metrics.get("grade_accuracy")]
    weights = [float(len(pairs)), float(len(grades))]
    if any(w for w in weights):
        result.metrics["accuracy"] = sum((a or 0.0) * w for a, w in zip(scored, weights)) / sum(weights)
    return result


def judged_verdict(decision, dimension: str | None) -> int | None:
    """The verdict an item labelled on ``dimension`` is scored by: that dimension's own, when the
    judge judged it, else the overall one."""
    if dimension and decision.dimensions is not None and dimension in decision.dimensions:
        return decision.dimensions[dimension]
    return decision.verdict


def dimension_metrics(judge: GenRMJudge, items: Sequence[dict], decisions: Sequence) -> dict[str, float]:
    """Per judged dimension: ``pairwise_accuracy.<d>`` over the items labelled on it (their label
    against the dimension's own verdict, unreadable counting as wrong), ``pairwise_items.<d>``, and
    ``pairwise_unreadable.<d>`` over every pair (a dimension the judge left out of its reply).
    Items labelled on a dimension the judge does not judge are counted in
    ``pairwise_items_unjudged_dimension`` (they are scored by the overall verdict)."""
    names = [d.name for d in judge.cfg.dimensions]
    out: dict[str, float] = {}
    if not names:
        return out
    for name in names:
        mine = [(r, d) for r, d in zip(items, decisions) if r.get("dimension") == name]
        if mine:
            out[f"pairwise_accuracy.{name}"] = sum(d.dimensions.get(name) == r["label"] if d.dimensions else False
                                                   for r, d in mine) / len(mine)
            out[f"pairwise_items.{name}"] = float(len(mine))
        read = [d for d in decisions if d.dimensions is not None]
        if read:
            out[f"pairwise_unreadable.{name}"] = sum(d.dimensions.get(name) is None for d in read) / len(read)
    out["pairwise_items_unjudged_dimension"] = float(sum(
        1 for r in items if r.get("dimension") and r["dimension"] not in names))
    return out


def synthetic_groups(items: Sequence[dict], decisions: Sequence) -> list[tuple[str, list, list]]:
    """(metric prefix, items, decisions) for all synthetic items together ("synthetic") and
    for each task ("synthetic_<task>"); empty when no item is synthetic."""
    synthetic = [(r, d) for r, d in zip(items, decisions) if str(r["origin"]).startswith(ORIGIN_SYNTHETIC)]
    groups = [("synthetic", synthetic)] if synthetic else []
    for origin in sorted({r["origin"] for r, _ in synthetic}):
        groups.append((origin.replace(":", "_"), [(r, d) for r, d in synthetic if r["origin"] == origin]))
    return [(name, [r for r, _ in pairs], [d for _, d in pairs]) for name, pairs in groups]


def pairwise_sample_metrics(items: Sequence[dict], decisions: Sequence, prefix: str) -> dict[str, float]:
    """Judge quality per raw sample and per decided pair, for one group of pairwise items.

    ``<prefix>_parseable``: share of raw judge samples (every order, every blind sample)
    the parser read; ``<prefix>_sample_accuracy``: share of raw samples whose verdict, put
    back in the item's frame (a swapped order's verdict negated), equals the label, chance
    0.5 on items labelled -1/1 (an unreadable sample counts as wrong);
    ``<prefix>_decision_accuracy``: share of pairs whose consistent decision equals the
    label (position switch and blind votes applied; disagreement reads as a tie).
    """
    samples = [(r, s) for r, d in zip(items, decisions) for s in d.samples]
    parsed = [s for _, s in samples if s.parsed.status == "ok"]
    right = sum(1 for r, s in samples if s.parsed.status == "ok"
                and (-s.parsed.value if s.order == BACKWARD else s.parsed.value) == r["label"])
    n = len(samples)
    return {f"{prefix}_parseable": len(parsed) / n if n else 0.0,
            f"{prefix}_sample_accuracy": right / n if n else 0.0,
            f"{prefix}_decision_accuracy": sum(d.verdict == r["label"] for r, d in zip(items, decisions)) / len(items),
            f"{prefix}_samples": float(n)}


def p_above_chance(hits: int, n: int, chance: float = 0.5) -> float:
    """One-sided exact binomial p-value: the chance of ``hits`` or more of ``n`` by guessing."""
    return float(sum(math.comb(n, k) * chance ** k * (1 - chance) ** (n - k) for k in range(hits, n + 1)))


def grade_metrics(items: Sequence[dict], decisions: Sequence, prefix: str) -> dict[str, float]:
    """``<prefix>grade_accuracy``: (reward >= 0.5) == label, an unreadable grade counting as
    wrong; ``<prefix>grade_p_vs_chance``: how likely that accuracy is by guessing (labels
    are balanced on the synthetic items, so chance is 0.5)."""
    hits = sum(d.reward is not None and (d.reward >= 0.5) == bool(r["label"]) for r, d in zip(items, decisions))
    n = len(items)
    return {f"{prefix}grade_accuracy": hits / n, f"{prefix}grade_p_vs_chance": p_above_chance(hits, n),
            f"{prefix}grade_unreadable": sum(d.reward is None for d in decisions) / n,
            f"{prefix}grade_items": float(n)}


def best_of_n_choice(rewards: Sequence[float | None], rng: random.Random) -> int:
    """Index of the highest reward; ties (and all-unreadable) broken by a seeded draw."""
    values = [r if r is not None else float("-inf") for r in rewards]
    top = max(values)
    return rng.choice([i for i, v in enumerate(values) if v == top])


def best_of_n_gap(judge: GenRMJudge, prompts: pl.DataFrame, backend: RolloutBackend | None,
                  cfg: ReferencesConfig, run_id: str | None) -> ValidationResult:
    """BoN accuracy (the GenRM's pick is right), pass@N (any of N is right) and their gap."""
    v = cfg.validation
    result = ValidationResult()
    rows = prompts.filter((pl.col("domain") == "math") & pl.col("answer").is_not_null()).sort("id") \
        .head(v.bon_prompts).to_dicts()
    constructed = 2 if v.bon_include_constructed else 0
    sampled = v.bon_n - constructed
    if not rows or (sampled > 0 and backend is None):
        log.warning("BoN check skipped: %s", "no math prompts with answers" if not rows else "no candidate backend")
        return result
    rng = random.Random(v.seed)
    candidates: list[list[str]] = [[] for _ in rows]
    if sampled > 0:
        rendered = [render_prompt(backend.format_chat, r["prompt"], "math") for r in rows]
        policy = next(s for s in cfg.candidates if s.kind == "backend")
        params = policy.rollout.sampling_params(n=sampled, seed=v.seed)
        candidates = [[c.text for c in outs] for outs in backend.generate(rendered, params)]
    if constructed:
        for r, cands in zip(rows, candidates):
            wrong = perturb_answer(str(r["answer"]), rng) or f"{r['answer']} + 1"
            cands += [boxed_response(str(r["answer"])), boxed_response(wrong)]
            rng.shuffle(cands)
    requests = [GradeRequest(r["prompt"], str(r["answer"]), text) for r, cands in zip(rows, candidates) for text in cands]
    decisions = iter(judge.grade(requests))
    bon_hits, pass_hits, errors = 0, 0, []
    for r, cands in zip(rows, candidates):
        graded = [next(decisions) for _ in cands]
        # through the registry: a candidate the verifier cannot settle (in time) is not right, and
        # is counted as the verifier's error rather than passing for a wrong answer
        verdicts = [verify_with_error("math", {"id": r["id"], "answer": str(r["answer"])}, text) for text in cands]
        correct = [score >= 1.0 for score, _ in verdicts]
        errors += [f"{r['id']}: {error}" for _, error in verdicts if error]
        bon_hits += correct[best_of_n_choice([d.reward for d in graded], rng)]
        pass_hits += pass_at_k(len(cands), sum(correct), len(cands))
        for i, d in enumerate(graded):
            result.judgments += judgment_rows(d.samples, run_id=run_id, context="bon", kind="grade",
                                              prompt_id=str(r["id"]), match_id=None, first_id=f"bon:{i}",
                                              second_id=None, judge_model=judge.model_name)
    if errors:
        log.warning("BoN check: the verifier could not score %d candidate(s); first: %s", len(errors), errors[0])
    result.metrics = {"bon_accuracy": bon_hits / len(rows), "pass_at_n": pass_hits / len(rows),
                      "bon_gap": (pass_hits - bon_hits) / len(rows), "bon_prompts": float(len(rows)),
                      "bon_n": float(v.bon_n), "bon_verify_errors": float(len(errors))}
    return result


def run_judge_validation(wh: Warehouse, cfg: ReferencesConfig, judge: GenRMJudge,
                         candidate_backends: dict[str, RolloutBackend] | None = None,
                         labelled_files: Sequence[str] = (), run_id: str | None = None,
                         sources: Mapping[str, TableRef] | None = None) -> tuple[dict[str, float], dict[str, TableRef]]:
    """Build the benchmark, score the judge on it, run the BoN check; store every judgment.
    Prompt tables are read at the snapshots in ``sources``, else at their newest (resolved once:
    the benchmark and the BoN check read the same snapshot)."""
    sources = {name: ref for name in ("prompts", "synthetic_tasks") if (ref := wh.pinned(name, sources)) is not None}
    bench_ref, quarantined = build_judge_benchmark(wh, cfg, labelled_files, run_id, sources)
    accuracy = judge_accuracy(judge, wh.read_ref(bench_ref), run_id)
    metrics = dict(accuracy.metrics, benchmark_items=float(bench_ref.rows), quarantined=float(quarantined))
    judgments = accuracy.judgments
    prompts = sources.get("prompts")
    if prompts is not None and cfg.validation.bon_prompts:
        policy = next((s.name for s in cfg.candidates if s.kind == "backend"), None)
        backend = (candidate_backends or {}).get(policy) if policy else None
        bon = best_of_n_gap(judge, wh.read_ref(prompts), backend, cfg, run_id)
        metrics.update(bon.metrics)
        judgments += bon.judgments
    spec = get_spec("judgments")
    frame = spec.conform(pl.DataFrame(judgments, schema=spec.schema)) if judgments else spec.empty()
    refs = {"judge_benchmark": bench_ref,
            "judgments": wh.append("judgments", frame, parents=[bench_ref])}
    return metrics, refs


# -- reading the results back ----------------------------------------------------------------

_JUDGE_COLUMNS = {"grade_accuracy": "grade accuracy", "grade_p_vs_chance": "p vs chance",
                  "grade_unreadable": "grades unread", "sample_accuracy": "pairwise accuracy",
                  "parseable": "pairwise read"}
_JUDGE_METRIC = re.compile(r"^(?P<group>synthetic(?:_[a-z0-9_]+?)?)_(?P<what>" + "|".join(_JUDGE_COLUMNS) + r")$")


def judge_table(metrics: dict[str, float]) -> list[dict]:
    """The judge on held-out synthetic items, one row per group (all synthetic items, then each
    task): grade accuracy (an unreadable grade counts as wrong), its p-value against guessing
    and the unreadable share, pairwise per-sample accuracy and the share of pairwise samples
    the parser read. ``metrics``: ``run_judge_validation``'s keys
    (a ``genrm.`` prefix, as logged to MLflow, is accepted). Empty without synthetic items."""
    rows: dict[str, dict] = {}
    for name, value in metrics.items():
        m = _JUDGE_METRIC.match(name.removeprefix("genrm."))
        if m:
            group = m["group"].removeprefix("synthetic").removeprefix("_") or "all synthetic"
            rows.setdefault(group, {"items": group})[_JUDGE_COLUMNS[m["what"]]] = float(value)
    order = ["items", *_JUDGE_COLUMNS.values()]
    return [{k: rows[g][k] for k in order if k in rows[g]} for g in sorted(rows, key=lambda g: (g != "all synthetic", g))]
