"""Data builders (warehouse tables -> ``sft_data``, ``dpo_pairs``, ``rl_prompts``); the
tokenized batches each stage trains on are ``tasks.train.encoding``'s.

Training sees only what curation chose. Each side reads its curated pool and the synthetic
instances assigned to it (``synthetic_tasks.split``), never raw ``prompts``:
- SFT: ``sft_pool`` rows and SFT-side synthetic instances; the target is a teacher's verified,
  cleaned sample with its reasoning (``teacher_samples``, rejection sampling), else the gold
  answer in the domain's format as a counted fallback (``response_source``).
- DPO: SFT-side prompts only; chosen = the policy's own verified-correct sample (``rollouts``
  written by the ``on_policy`` samples job from the model DPO starts from) or the gold answer;
  rejected = its verified-wrong sample, else a verifier-rejected perturbation of the gold
  (``chosen_source`` / ``rejected_source`` say which, and the build report counts them).
- RL: ``rl_pool`` rows and RL-side synthetic instances whose *latest* difficulty decision
  is ``keep`` (``unscored`` for domains without a verifier band).
Every built table is split short/long by token length, as MiniMax-01 trains them apart.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import polars as pl

from data_specs import get_spec
from data_specs.curation import POOL_TABLES
from data_specs.stages import TRAINING_TABLES, stages_reading
from tasks.cleaning import CleanConfig, clean_reason
from tasks.genrm.config import JUDGE_DOMAIN, OPEN_DOMAINS
from tasks.train.config import TrainConfig
from tasks.train.encoding import encode_example, stage_of_length
from tasks.verify.registry import VERIFIED_FIELDS, verify_with_error
from warehouse import TableRef, Warehouse
from warehouse.store import frame_digest

log = logging.getLogger("posttrain.train.data")


def _stable_id(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- sources


@dataclass
class BuildReport:
    """Counts of a builder: rows seen, kept, dropped by reason, and kept rows by kind (where
    their response came from: teacher, gold fallback, sampled or perturbed rejected side).

    Every builder also lists each row it leaves out as a ``decisions`` row (``remove``: the
    row's prompt / instance id, the builder's ``decision_stage`` and the reason; the
    example's or pair's own id as ``reference_id`` where it had one); ``build_table`` appends
    them with the table. seen = kept + dropped, and dropped = the decisions listed."""
    seen: int = 0
    kept: int = 0
    dropped: dict[str, int] | None = None
    kinds: dict[str, int] | None = None
    decisions: list[dict] | None = None

    def drop(self, reason: str) -> None:
        self.dropped = self.dropped or {}
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def remove(self, row_id: str, stage: str, reason: str, reference_id: str | None = None) -> None:
        """``drop`` a row, and keep it as a ``decisions`` row of ``stage`` with its reason."""
        self.drop(reason)
        self.decisions = self.decisions or []
        self.decisions.append({"row_id": str(row_id), "stage": stage, "decision": "removed", "reason": reason,
                               "reference_id": reference_id, "score": None})

    def absorb(self, other: BuildReport) -> None:
        """Take ``other``'s rows left out (counted in ``seen`` too, and listed) and its kinds."""
        for reason, count in (other.dropped or {}).items():
            self.seen += count
            self.dropped = self.dropped or {}
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        if other.decisions:
            self.decisions = (self.decisions or []) + other.decisions
        for kind, count in (other.kinds or {}).items():
            self.tally(kind, count)

    def tally(self, kind: str, count: int = 1) -> None:
        self.kinds = self.kinds or {}
        self.kinds[kind] = self.kinds.get(kind, 0) + count

    def counters(self) -> dict[str, float]:
        out = {"seen": float(self.seen), "kept": float(self.kept)}
        out.update({f"dropped_{k}": float(v) for k, v in (self.dropped or {}).items()})
        out.update({k: float(v) for k, v in (self.kinds or {}).items()})
        return out


def decision_stage(table: str) -> str:
    """The ``decisions.stage`` of a row the builder of training table ``table`` leaves out."""
    return f"train.{table}"


class Sources:
    """The snapshots one training table is built from, pinned once: every builder read goes to
    one of them (a table the stage registry declares as a source), never to "latest"."""

    def __init__(self, wh: Warehouse, table: str, refs: dict[str, TableRef | None] | None = None):
        declared = TRAINING_TABLES[table].sources
        refs = refs if refs is not None else {t: wh.latest(t) for t in declared}
        extra = set(refs) - set(declared)
        if extra:
            raise ValueError(f"{table} is built from {list(declared)}, not {sorted(extra)}")
        self.wh, self.table, self.refs = wh, table, {t: refs.get(t) for t in declared}

    def read(self, name: str) -> tuple[pl.DataFrame, TableRef | None]:
        """The pinned snapshot of ``name`` (an empty frame and None where the table did not exist)."""
        if name not in self.refs:
            raise KeyError(f"the {self.table} builder read {name!r}, which data_specs/stages.py does not "
                           f"declare among its sources {list(self.refs)}")
        ref = self.refs[name]
        return (pl.DataFrame(), None) if ref is None else (self.wh.read(ref.name, ref.snapshot), ref)

    def key(self) -> dict[str, str]:
        return {t: str(r) if r else f"{t}@none" for t, r in self.refs.items()}


def _gold_response(row: dict) -> str | None:
    """The stored solution and answer as a target in the answer format of the row's domain
    (``tasks.rollout.chat``): math ends in ``\\boxed{}``, code is one fenced block, logic ends in
    ``<answer>`` tags, and an open prompt's reference is the whole response, untagged (tags would
    break its own format constraints). None when there is nothing to show."""
    return gold_response(row.get("domain"), row.get("solution"), row.get("answer"))


def gold_response(domain: str | None, solution: str | None, answer: str | None) -> str | None:
    solution, answer = (solution or "").strip(), (answer or "").strip()
    if domain == "code":
        if not solution:
            return None   # a code row's answer is its tests' verdict, not a text to imitate
        return solution if "```" in solution else f"```python\n{solution}\n```"
    if domain in ("math", "logic"):
        if not answer:
            return solution or None
        if domain == "math":
            final = answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"
            if "\\boxed" in solution:
                return solution
            return f"{solution}\n\nThe final answer is {final}." if solution else f"The final answer is {final}."
        return f"{solution}\n<answer>{answer}</answer>" if solution else f"<answer>{answer}</answer>"
    return solution or answer or None

def gold_clean_reason(domain: str, row: dict, response: str, cfg: CleanConfig | None) -> str | None:
    """Why a gold worked solution may not train (None: it may): the cleaning teacher samples pass
    (``tasks.cleaning.clean_reason``), after the domain's verifier scored it as a sample, so a
    stored solution that boxes another answer than the row's is ``wrong``. An open prompt's gold
    is its reference: only the text checks apply (no rule verifier, no constraints to hold). A
    row with no solution, only its answer, is not a worked solution: its bare answer trains
    where ``data.gold_fallback_domains`` lets it (the tiny model learns from exactly those)."""
    if cfg is None or not str(row.get("solution") or "").strip():
        return None
    if domain in OPEN_DOMAINS or domain == JUDGE_DOMAIN:
        return clean_reason(domain, _GoldSample(_GoldText(response), 1.0, None), cfg, constraints_ok=True)
    score, error = verify_with_error(domain, row, response)
    return clean_reason(domain, _GoldSample(_GoldText(response), score, error), cfg)


@dataclass
class _GoldText:     # a stored solution as clean_reason reads a completion: whole, never cut off
    text: str
    truncated: bool = False


@dataclass
class _GoldSample:   # ... and as it reads a scored sample
    completion: _GoldText
    reward: float
    error: str | None


def _cap_per_task(df: pl.DataFrame, cap: int | None) -> pl.DataFrame:
    """At most ``cap`` rows per task (None: all), by id, grouped by task in the order of each
    task's smallest id."""
    if df.is_empty() or "task" not in df.columns:
        return df
    return df.sort("id").group_by("task", maintain_order=True).head(cap if cap is not None else df.height)


def side_rows(src: Sources, side: str, cfg: TrainConfig, refs: list[TableRef],
              capped: bool = True, report: BuildReport | None = None) -> dict[str, dict]:
    """Every row one side may train on, by id: its curated pool, then the synthetic
    instances assigned to it (at most ``data.synthetic_per_task`` per task unless not
    ``capped``; ``report`` gets those over the cap, ``over_synthetic_per_task``). Never raw
    ``prompts``: curation chose the text that trains."""
    pool_name = POOL_TABLES[side]
    out: dict[str, dict] = {}
    pool, ref = src.read(pool_name)
    if ref is not None:
        refs.append(ref)
        for r in pool.iter_rows(named=True):
            out[str(r["id"])] = {**r, "_table": pool_name}
    cap = cfg.data.synthetic_per_task if capped else None
    for pid, r in synthetic_side(src, side, cap, refs, report).items():
        out.setdefault(pid, r)
    return out


def synthetic_side(src: Sources, side: str, cap: int | None, refs: list[TableRef],
                   report: BuildReport | None = None) -> dict[str, dict]:
    """The synthetic instances assigned to ``side`` by id (at most ``cap`` per task; ``report``
    gets each one over the cap as removed, ``over_synthetic_per_task``)."""
    synth, sref = src.read("synthetic_tasks")
    if sref is None or synth.is_empty():
        return {}
    if "split" not in synth.columns:
        raise ValueError(f"{sref} has no 'split' column (written before synthetic instances had a side): "
                         "re-run `posttrain synthesize`")
    refs.append(sref)
    offered = synth.filter(pl.col("split") == side)
    mine = _cap_per_task(offered, cap)
    if report is not None and mine.height < offered.height:
        taken = set(mine["id"])
        for r in offered.sort("id").iter_rows(named=True):
            if r["id"] not in taken:
                report.remove(r["id"], decision_stage(src.table), "over_synthetic_per_task", f"task:{r['task']}")
    return {r["id"]: {**r, "_table": "synthetic_tasks"} for r in mine.iter_rows(named=True)}


def kept_teacher_samples(src: Sources, refs: list[TableRef]) -> dict[str, list[dict]]:
    """prompt_id -> the teacher's kept (verified, clean) samples, newest run first."""
    samples, ref = src.read("teacher_samples")
    if ref is None or samples.is_empty():
        return {}
    refs.append(ref)
    out: dict[str, list[dict]] = {}
    for r in reversed(samples.filter(pl.col("kept")).to_dicts()):
        out.setdefault(r["prompt_id"], []).append(r)
    return out


def sft_source_rows(src: Sources, cfg: TrainConfig, report: BuildReport | None = None,
                    ) -> tuple[list[dict], list[TableRef]]:
    """Rows with (source_table, source_id, domain, prompt, response, response_source) from the
    SFT side: a prompt's verified teacher samples (up to ``data.teacher_samples_per_prompt``),
    else its gold answer in its domain's format when ``data.gold_fallback`` (for the domains in
    ``data.gold_fallback_domains``; counted in ``report``), else none (``no_teacher_sample``).
    ``report`` gets each prompt that gave no row as removed, with its reason."""
    refs: list[TableRef] = []
    rows = []
    golds: list[tuple[int, str, dict]] = []    # (index in rows, prompt id, source row) of each gold target
    sft_side = side_rows(src, "sft", cfg, refs, report=report)
    teacher = kept_teacher_samples(src, refs)
    for pid, r in sft_side.items():
        base = {"source_table": r["_table"], "source_id": pid, "domain": r.get("domain") or "general",
                "prompt": r.get("prompt") or ""}
        samples = teacher.get(pid, [])[: cfg.data.teacher_samples_per_prompt]
        for s in samples:
            rows.append({**base, "response": s["text"], "response_source": "teacher", "sample_id": s["rollout_id"],
                         "sample_model": s["model"]})
        if samples:
            continue
        fallback = cfg.data.gold_fallback and (cfg.data.gold_fallback_domains is None
                                               or base["domain"] in cfg.data.gold_fallback_domains)
        response = _gold_response(r) if fallback else None
        rejected = gold_clean_reason(base["domain"], r, response, cfg.data.gold_clean) if response else None
        if response and rejected is None:
            golds.append((len(rows), pid, r))
            rows.append({**base, "response": response, "response_source": "gold"})
        elif report is not None:
            report.remove(pid, decision_stage(src.table), f"gold_{rejected}" if rejected else
                          "no_teacher_sample" if not fallback else "no_gold_answer")
    if cfg.data.gold_judge.enabled:
        judged_out = gold_judge_rejections(src.wh, cfg, [(i, pid, r, rows[i]) for i, pid, r in golds])
        for i, reason in sorted(judged_out.items()):
            if report is not None:
                report.remove(rows[i]["source_id"], decision_stage(src.table), reason)
        rows = [row for i, row in enumerate(rows) if i not in judged_out]
    if cfg.data.judge_in_sft:  # the policy learns the GenRM judge's jobs too
        rows += judge_rows(src, cfg, [], report)
    return rows, refs


def gold_judge_rejections(wh: Warehouse, cfg: TrainConfig, golds: list[tuple[int, str, dict, dict]],
                          backend=None) -> dict[int, str]:
    """M2's LLM-judge check of the gold worked solutions the rules passed: index -> the reason it
    does not train (``gold_judge_rejected``: graded below ``min_grade``; ``gold_judge_unread``,
    with ``on_unread: drop``). Only worked solutions (a row with a ``solution``) in the judge's
    domains are checked, all in one ``check_reasoning`` call; the judge model loads only when there
    is one to check. ``backend``: a judge backend to use instead of the configured one (tests)."""
    from tasks.genrm.judge import GenRMJudge, GradeRequest

    judge_cfg = cfg.data.gold_judge
    todo = [(i, row, target) for i, _pid, row, target in golds
            if target["domain"] in judge_cfg.domains and str(row.get("solution") or "").strip()]
    if not todo:
        return {}
    if backend is None:
        from tasks.genrm.models import resolve_rollout
        from tasks.rollout.factory import make_backend

        backend = make_backend(resolve_rollout(judge_cfg.judge.rollout, str(wh.home)))
        owned = backend
    else:
        owned = None
    judge = GenRMJudge(backend, judge_cfg.judge, seed=cfg.seed)
    requests = [GradeRequest(target["prompt"], str(row.get("answer") or ""), str(row.get("solution")))
                for _i, row, target in todo]
    try:
        decisions = judge.check_reasoning(requests)
    finally:   # a backend this check opened (a loaded model, a server client) is not kept past it
        if owned is not None and callable(getattr(owned, "close", None)):
            owned.close()
    # the grade a reward stands for: grade_rewards maps 1..5 to [0, 1], increasing
    bar = judge_cfg.judge.grade_rewards[judge_cfg.min_grade]
    out: dict[int, str] = {}
    unread = 0
    for (i, _row, _target), decision in zip(todo, decisions, strict=True):
        if decision.reward is None:
            unread += 1
            if judge_cfg.on_unread == "drop":
                out[i] = "gold_judge_unread"
        elif decision.reward < bar - 1e-9:
            out[i] = "gold_judge_rejected"
    log.info("gold judge: %d worked solutions checked, %d rejected, %d unread (%s)", len(todo),
             sum(r == "gold_judge_rejected" for r in out.values()), unread,
             "dropped" if judge_cfg.on_unread == "drop" else "kept")
    return out


def judge_rows(src: Sources, cfg: TrainConfig, refs: list[TableRef], report: BuildReport | None = None) -> list[dict]:
    """The GenRM judge's examples on SFT-side synthetic instances (every one, not capped like
    the policy's own answer rows). ``report`` gets what became of the instances
    (``judge_instances_*``, ``judge_tasks_without_examples``; ``judge_data.JudgeAccount``), and
    each instance that gave no example as removed (``judge_<why>``, the reference its task)."""
    from tasks.train.judge_data import JudgeAccount, judge_sft_rows, open_pair_rows

    account = JudgeAccount()
    rows = judge_sft_rows(synthetic_side(src, "sft", None, refs), cfg.data.judge_examples_per_task, cfg.seed,
                          cfg.data.judge_pairwise_share, cfg.data.judge_max_chars, account, cfg.data.judge_tasks)
    if report is not None:
        for kind, count in account.counters().items():
            report.tally(kind, count)
        for instance_id, why, task in account.removed:
            report.remove(instance_id, decision_stage(src.table), f"judge_{why}", f"task:{task}" if task else None)
    if cfg.data.judge_open_pairs:
        pool, ref = src.read(POOL_TABLES["sft"])
        if ref is not None:
            refs.append(ref)
            open_rows = [{"id": str(r["id"]), "_table": ref.name, "prompt": r.get("prompt"), "gold": _gold_response(r)}
                         for r in pool.iter_rows(named=True) if r.get("domain") in OPEN_DOMAINS]
            rows += open_pair_rows(open_rows, cfg.data.judge_open_pairs, cfg.seed, cfg.data.judge_max_chars)
    return rows


def _cap_per_stage(rows: list[dict], cap: int, report: BuildReport, table: str, row_key: str,
                   own_key: str) -> list[dict]:
    """At most ``cap`` rows per stage (short / long), in order; the rest removed (``over_max_<stage>``),
    each by its ``row_key`` (the prompt / instance) and ``own_key`` (the example / pair)."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r["stage"]] = seen.get(r["stage"], 0) + 1
        if seen[r["stage"]] <= cap:
            out.append(r)
        else:
            report.remove(r[row_key], decision_stage(table), f"over_max_{r['stage']}", r[own_key])
    return out


def build_sft_data(src: Sources, cfg: TrainConfig, tokenizer) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """The ``sft_data`` frame: each example assigned to sft_short or sft_long by token length."""
    unmatched = BuildReport()
    rows, refs = sft_source_rows(src, cfg, unmatched)
    frame, refs, report = _sft_frame(rows, refs, src.table, cfg, tokenizer)
    report.absorb(unmatched)   # prompts and judge instances that gave no row, and the instances' counts
    return frame, refs, report


def build_judge_data(src: Sources, cfg: TrainConfig, tokenizer) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """The ``judge_data`` frame: the judge stage's examples (none unless the profile asks)."""
    refs: list[TableRef] = []
    instances = BuildReport()
    rows = judge_rows(src, cfg, refs, instances) if cfg.data.judge_examples_per_task else []
    frame, refs, report = _sft_frame(rows, refs, src.table, cfg, tokenizer)
    report.absorb(instances)   # the instances that gave no example, and their counts
    return frame, refs, report


def _sft_frame(rows: list[dict], refs: list[TableRef], table: str, cfg: TrainConfig,
               tokenizer) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """Prompt/response rows as a table of SFT examples, each assigned by its token length to
    the stage of ``table`` whose range holds it. A row left out is removed with its reason
    (its ``source_id``, and the ``example_id`` it would have had); a row repeating an earlier
    one (the same ``example_id``: the same source and text) is that row, kept once and counted
    as ``duplicate_examples``, not as a row seen."""
    ranges = cfg.token_ranges(table)
    stage_name = decision_stage(table)
    report, out, ids_seen = BuildReport(), [], set()
    for r in rows:
        # a judge example's prompt is its own (answers in their slots): two pairs on one source differ by it
        key = (r["prompt"],) if r.get("domain") == JUDGE_DOMAIN else ()
        example_id = _stable_id(r["source_table"], r["source_id"], r["response"], *key)
        if example_id in ids_seen:
            report.tally("duplicate_examples")
            continue
        ids_seen.add(example_id)
        report.seen += 1
        if not r["prompt"].strip() or not r["response"].strip():
            report.remove(r["source_id"], stage_name, "empty", example_id)
            continue
        ids, n_prompt = encode_example(tokenizer, r["prompt"], r["response"], r.get("domain"))
        stage = stage_of_length(len(ids), ranges)
        if stage is None:
            report.remove(r["source_id"], stage_name, "outside_length_ranges", example_id)
            continue
        out.append({**r, "example_id": example_id,
                    "stage": stage, "num_tokens": len(ids), "response_tokens": len(ids) - n_prompt})
    out = _cap_per_stage(out, cfg.data.max_sft_examples, report, table, "source_id", "example_id")
    report.kept = len(out)
    for r in out:
        report.tally(f"source_{r['response_source']}")
    frame = pl.DataFrame(out, infer_schema_length=None) if out else pl.DataFrame()
    return frame, refs, report


# --------------------------------------------------------------------------- DPO


def _chosen_candidates(rollouts: pl.DataFrame, prompts: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """prompt_id -> (response, source): a correct rollout first, then gold."""
    chosen: dict[str, tuple[str, str]] = {}
    if not rollouts.is_empty():
        good = rollouts.filter((pl.col("reward") >= 1.0) & pl.col("text").is_not_null()).sort("rollout_id")
        for r in good.filter(pl.col("prompt_id").is_in(list(prompts))).iter_rows(named=True):
            chosen.setdefault(r["prompt_id"], (r["text"], "rollout_correct"))
    for pid, row in prompts.items():
        gold = _gold_response(row)
        if gold:
            chosen.setdefault(pid, (gold, "gold"))
    return chosen


def _rejected_candidates(rollouts: pl.DataFrame) -> dict[str, str]:
    if rollouts.is_empty():
        return {}
    bad = rollouts.filter((pl.col("reward") <= 0.0) & pl.col("text").is_not_null()
                          & (pl.col("text").str.strip_chars().str.len_chars() > 0)).sort("rollout_id")
    out: dict[str, str] = {}
    for r in bad.iter_rows(named=True):
        out.setdefault(r["prompt_id"], r["text"])
    return out


def _perturbed_negative(row: dict, seed: int) -> tuple[str | None, str | None]:
    """(a certainly-wrong answer from the synthetic task's own perturbations, checked by its
    verifier, None) or (None, why there is none): ``not_synthetic``, ``no_perturbation`` (the
    task offers none; a reasoning-gym task offers edits its ``score_answer`` rejects), ``all_accepted``,
    ``verify_error`` (the verifier failed on the instance: its 0 is no proof of a wrong answer) or
    ``task_error`` (the task or its instance could not be rebuilt)."""
    if row.get("_table") != "synthetic_tasks":
        return None, "not_synthetic"
    from tasks.synth.base import TaskVerifyError
    from tasks.synth.registry import get_task
    from tasks.verify.registry import synth_instance

    try:
        task = get_task(row["task"])
        instance = synth_instance(row)
        perturbations = task.perturbations(instance, random.Random(seed))
        for wrong in perturbations:
            response = f"<answer>{wrong}</answer>"
            if task.verify_strict(instance, response) < 1.0:
                return response, None
    except TaskVerifyError:
        return None, "verify_error"
    except Exception:  # noqa: BLE001 - a task that cannot be rebuilt yields no pair, counted
        return None, "task_error"
    return None, "all_accepted" if perturbations else "no_perturbation"


def build_dpo_pairs(src: Sources, cfg: TrainConfig, tokenizer) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """The ``dpo_pairs`` frame: one pair per SFT-side prompt that has a chosen and a rejected
    side, by the longer side's token length in the DPO stage whose range holds it. Every other
    prompt is removed with its reason (``decision_stage``), its ``pair_id`` as the reference
    where the pair was made."""
    refs: list[TableRef] = []
    report, stage_name = BuildReport(), decision_stage(src.table)
    prompts = side_rows(src, "sft", cfg, refs, report=report)   # DPO trains on the SFT side only
    # rollouts sampled outside training (the RL stage keeps its own in rl_rollouts, never read here)
    rollouts, rref = src.read("rollouts")
    refs += [rref] if rref is not None else []
    chosen = _chosen_candidates(rollouts, prompts)
    rejected = _rejected_candidates(rollouts)
    ranges = cfg.token_ranges(src.table)
    report.seen, out = len(prompts) + len(report.decisions or []), []   # those over the cap were offered too
    for pid in prompts:
        if pid not in chosen:   # no correct rollout and no gold answer to show
            report.remove(pid, stage_name, "no_chosen")
    for pid, (good, good_source) in chosen.items():
        row = prompts.get(pid)
        if row is None:
            report.remove(pid, stage_name, "prompt_not_found")
            continue
        domain = row.get("domain") or "general"
        checkable = cfg.data.verify_chosen and domain in ("math", "logic")
        if checkable:
            score, error = verify_with_error(domain, row, good)
            if score < 1.0:   # a verifier that failed is counted apart from a chosen side it rejected
                report.remove(pid, stage_name, "chosen_verify_error" if error else "chosen_not_verified")
                continue
        bad, bad_source, why = rejected.get(pid), "rollout_wrong", None
        if bad is None and cfg.data.dpo_perturbed_negatives:
            (bad, why), bad_source = _perturbed_negative(row, cfg.seed), "perturbed"
        if bad is None:
            report.remove(pid, stage_name, f"no_rejected_{why}" if why else "no_rejected")
            continue
        pair_id = _stable_id(pid, good, bad)
        longest = max(len(encode_example(tokenizer, row["prompt"], text, domain)[0]) for text in (good, bad))
        stage = stage_of_length(longest, ranges)
        if stage is None:
            report.remove(pid, stage_name, "outside_length_ranges", pair_id)
            continue
        out.append({"pair_id": pair_id, "stage": stage, "prompt_id": pid,
                    "source_table": row["_table"], "domain": domain, "prompt": row["prompt"],
                    "chosen": good, "rejected": bad, "chosen_source": good_source,
                    "rejected_source": bad_source, "num_tokens": longest})
    out = _cap_per_stage(out, cfg.data.max_dpo_pairs, report, src.table, "prompt_id", "pair_id")
    report.kept = len(out)
    for r in out:
        report.tally(f"chosen_{r['chosen_source']}")
        report.tally(f"rejected_{r['rejected_source']}")
    return (pl.DataFrame(out) if out else pl.DataFrame()), refs, report


# --------------------------------------------------------------------------- RL


# the ``decisions.stage`` of an RL-side row the rl_prompts builder leaves out
RL_PROMPTS_STAGE = decision_stage("rl_prompts")


def _rl_row(row: dict, table: str, selected_by: str) -> dict:
    """The RL prompt with the fields its verifier (``verify(domain, row, response)``) reads."""
    return {"prompt_id": str(row["id"]), "source_table": table, "domain": row.get("domain") or "general",
            "prompt": row["prompt"], **{f: row.get(f) for f in VERIFIED_FIELDS}, "selected_by": selected_by}


def latest_difficulty_decisions(src: Sources) -> tuple[dict[str, str], TableRef | None]:
    """prompt_id -> its newest difficulty decision, and the snapshot it was read from."""
    from tasks.scoring import latest_decisions

    difficulty, ref = src.read("difficulty")
    return (latest_decisions(difficulty) if ref is not None else {}), ref


def build_rl_prompts(src: Sources, cfg: TrainConfig) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """The RL side's rows whose latest difficulty decision keeps them (``unscored``: a domain
    with no verifier band, rewarded by the GenRM)."""
    refs: list[TableRef] = []
    # every RL-side instance: difficulty samples among all of them, and the per-task cap
    # applies to those it kept (capping first would drop kept prompts for ones never scored)
    candidates = side_rows(src, "rl", cfg, refs, capped=False)
    decisions, dref = latest_difficulty_decisions(src)
    if dref is not None:
        refs.append(dref)
    report, rows = BuildReport(seen=len(candidates)), []
    per_task: dict[str, int] = {}
    cap = cfg.data.synthetic_per_task
    for pid, row in candidates.items():
        decision = decisions.get(pid)
        undecided_ok = decision is None and not cfg.data.rl_requires_difficulty
        if decision not in ("keep", "unscored") and not undecided_ok:
            report.remove(pid, RL_PROMPTS_STAGE, f"difficulty_{decision or 'missing'}",
                          str(dref) if dref is not None and decision is not None else None)
            continue
        task = row.get("task") if row["_table"] == "synthetic_tasks" else None
        if task is not None and cap is not None:
            taken = per_task.get(task, 0)
            if taken >= cap:
                report.remove(pid, RL_PROMPTS_STAGE, "over_synthetic_per_task", f"task:{task}")
                continue
            per_task[task] = taken + 1
        rows.append(_rl_row(row, row["_table"], "difficulty_keep" if decision is not None else row["_table"]))
    if cfg.rl.max_prompts is not None and len(rows) > cfg.rl.max_prompts:
        for r in rows[cfg.rl.max_prompts:]:
            report.remove(r["prompt_id"], RL_PROMPTS_STAGE, "over_max_prompts")
        rows = rows[: cfg.rl.max_prompts]
    report.kept = len(rows)
    return (pl.DataFrame(rows) if rows else pl.DataFrame()), refs, report


def rl_genrm_prompts(wh: Warehouse, cfg: TrainConfig, sources: dict[str, TableRef] | None = None) -> int:
    """How many of the RL stage's prompts the GenRM judges (``rl_prompts`` as the stage would build
    it from ``sources``, else from the newest snapshots): 0 when that reward is off or no prompt is in
    its domains. The pipeline asks before RL waits for the judge; nothing is written."""
    if not cfg.rl.genrm.enabled:
        return 0
    pinned = None if sources is None else {t: wh.pinned(t, sources) for t in TRAINING_TABLES["rl_prompts"].sources}
    frame, _, _ = build_rl_prompts(Sources(wh, "rl_prompts", pinned), cfg)
    judged = [*cfg.rl.genrm.domains, *cfg.rl.genrm.grade_domains]
    return 0 if frame.is_empty() else frame.filter(pl.col("domain").is_in(judged)).height


def build_agent_tasks(src: Sources, cfg: TrainConfig) -> tuple[pl.DataFrame, list[TableRef], BuildReport]:
    """One row per training episode of each of the agent stage's environments: the environment,
    its settings and a training seed (0 .. train_seeds-1; evaluation seeds lie in
    ``data_specs.agents.HELDOUT_SEED_BASE`` and above), with the opening user message for the audit."""
    from tasks.agents.envs import make_env

    rows, report = [], BuildReport()
    for stage in stages_reading("agent_tasks"):
        for env_cfg in cfg.stage(stage).environments:
            settings = json.dumps(env_cfg.settings, sort_keys=True)
            env = make_env(env_cfg.name, **env_cfg.settings)
            for seed in range(env_cfg.train_seeds):
                report.seen += 1
                opening = env.reset(seed).messages
                prompt = next((m["content"] for m in reversed(opening) if m["role"] == "user"), opening[-1]["content"])
                rows.append({"task_id": f"{env_cfg.name}:{_stable_id(settings)[:8]}:{seed}", "stage": stage,
                             "environment": env_cfg.name, "settings": settings, "seed": seed, "prompt": prompt})
            env.close()
    report.kept = len(rows)
    return (pl.DataFrame(rows) if rows else pl.DataFrame()), [], report


def write_if_changed(wh: Warehouse, name: str, frame: pl.DataFrame, parents: list[TableRef],
                     note: str | None = None) -> TableRef:
    """A new snapshot only when the content changed, so unchanged data keeps stages resumable."""
    spec = get_spec(name)
    valid = spec.validate(frame)[0] if spec else frame
    latest = wh.latest(name)
    if latest is not None and latest.content_hash == frame_digest(valid):
        return latest
    return wh.write(name, frame, parents=_unique_refs(parents), note=note)


BUILDERS: dict[str, Callable[[Sources, TrainConfig, object], tuple[pl.DataFrame, list[TableRef], BuildReport]]] = {
    "sft_data": build_sft_data,
    "dpo_pairs": build_dpo_pairs,
    "rl_prompts": lambda src, cfg, tokenizer: build_rl_prompts(src, cfg),
    "judge_data": build_judge_data,
    "agent_tasks": lambda src, cfg, tokenizer: build_agent_tasks(src, cfg),
}


def build_key(src: Sources, cfg: TrainConfig, tokenizer) -> str:
    """What a training table is a function of: its pinned sources and the build settings."""
    stages = {s: cfg.stage(s).model_dump() for s in stages_reading(src.table)}
    settings = {"data": cfg.data.model_dump(), "stages": stages, "seed": cfg.seed,
                "tokenizer": [getattr(tokenizer, "name_or_path", None), len(tokenizer)]}
    return _stable_id(json.dumps({"sources": src.key(), "settings": settings}, sort_keys=True, default=str))


def build_table(wh: Warehouse, name: str, cfg: TrainConfig, tokenizer,
                sources: dict[str, TableRef | None] | None = None) -> tuple[TableRef | None, BuildReport | None]:
    """Build one training table from its sources (these snapshots, else each source's newest,
    looked up once here) and write it if it changed; an up-to-date table is not rebuilt.

    The builder reads only through the pinned sources, which are the tables the stage
    registry declares for it: the pipeline's cache and the table's lineage name exactly those.
    """
    src = Sources(wh, name, sources)
    key = build_key(src, cfg, tokenizer)
    latest = wh.latest(name)
    if latest is not None and _snapshot_note(wh, latest).get("build_key") == key:
        return latest, None
    frame, parents, report = BUILDERS[name](src, cfg, tokenizer)
    ref = None if frame.is_empty() else write_if_changed(wh, name, frame, parents,
                                                         note=json.dumps({"build_key": key}))
    if report.decisions:
        _record_decisions(wh, name, report.decisions, parents)
    return ref, report


def _record_decisions(wh: Warehouse, name: str, decisions: list[dict], parents: list[TableRef]) -> None:
    """Append the rows a build of ``name`` left out to ``decisions``, once: their ``run_id`` is a
    digest of them, so a rebuild that leaves out the same rows for the same reasons (new settings,
    the same table) records nothing again."""
    build = f"{name}:{_stable_id(name, json.dumps(decisions, sort_keys=True, default=str))}"
    if wh.exists("decisions") and wh.scan("decisions").filter(pl.col("run_id") == build).head(1).collect().height:
        return
    rows = [{**d, "run_id": build} for d in decisions]
    wh.append("decisions", get_spec("decisions").conform(pl.DataFrame(rows, infer_schema_length=None)),
              parents=_unique_refs(parents), note=f"{name} build")


def _snapshot_note(wh: Warehouse, ref: TableRef) -> dict:
    row = wh.history(ref.name).filter(pl.col("snapshot") == ref.snapshot)
    note = row["note"][0] if row.height else None
    try:
        return json.loads(note) if note else {}
    except json.JSONDecodeError:
        return {}


def write_training_tables(wh: Warehouse, cfg: TrainConfig, tokenizer, tables: Sequence[str] | None = None,
                          sources: dict[str, TableRef] | None = None,
                          ) -> tuple[dict[str, TableRef], dict[str, BuildReport]]:
    """Build the named training tables (all by default) and write those that changed.

    ``sources``: snapshots handed over by earlier stages; each table is built from those of
    its declared sources, and a declared source not among them is looked up at its newest."""
    refs: dict[str, TableRef] = {}
    reports: dict[str, BuildReport] = {}
    for name in tables if tables is not None else TRAINING_TABLES:
        pinned = None if sources is None else {t: wh.pinned(t, sources) for t in TRAINING_TABLES[name].sources}
        ref, report = build_table(wh, name, cfg, tokenizer, pinned)
        if report is not None:
            reports[name] = report
        if ref is not None:
            refs[name] = ref
    return refs, reports


def _unique_refs(refs: list[TableRef]) -> list[TableRef]:
    seen, out = set(), []
    for r in refs:
        if str(r) not in seen:
            seen.add(str(r))
            out.append(r)
    return out
