"""The training-data audit: proves from the warehouse alone that training saw only what
curation and difficulty chose.

Checks (each counts what it checked and names every offending id):
- ``sft_side`` / ``dpo_side`` / ``rl_side`` / ``judge_side``: every row of ``sft_data``,
  ``dpo_pairs``, ``rl_prompts`` and ``judge_data`` maps to a kept pool row (``sft_pool`` /
  ``rl_pool``) or a synthetic instance assigned to its own side (the judge's: SFT), with
  the very prompt text curation kept (a judge example quotes it inside its judge prompt).
- ``no_prompt_on_both_sides`` / ``no_cluster_on_both_sides``: no prompt id, prompt text or
  near-duplicate cluster feeds both the SFT side (SFT, DPO) and the RL side.
- ``no_benchmark_item``: no training prompt is a benchmark item (same normalized text) or a
  row that decontamination matched to one.
- ``rl_latest_difficulty_keep``: every RL prompt's newest difficulty decision keeps it
  (``unscored`` only for domains without a verifier band, which the GenRM rewards).
- ``sampled_targets_verified``: every SFT target taken from a teacher is a kept (verified,
  clean) teacher sample of its own prompt, and every DPO side taken from the policy's samples
  is one of that prompt's samples, verified right (chosen) or wrong (rejected).
- ``training_snapshots``: what is audited exists. The rows audited are those the newest model
  of each stage trained on (the snapshots its ``models.data_snapshots`` names) and the newest
  snapshot of each training table (what the next stage would train on); a snapshot a model
  names that the warehouse no longer holds, or a home with no training table at all, fails.

Each audited training snapshot is checked against the snapshots it was built from (its
lineage parents: the pools, synthetic instances, difficulty decisions, teacher samples and
rollouts of its build), not against whatever is newest now, so a later difficulty run cannot
fail an earlier, correct model; a source its lineage does not name is read at its newest.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import polars as pl

from data_specs.curation import POOL_TABLES
from tasks.genrm.config import JUDGE_DOMAIN
from tasks.model_registry import read_models
from tasks.scoring import latest_decisions
from tasks.text import normalize_texts, text_hash
from warehouse import TableRef, Warehouse

MAX_LISTED = 20
SIDE_OF_TABLE = {"sft_data": "sft", "dpo_pairs": "sft", "rl_prompts": "rl", "judge_data": "sft"}
# the agent stage's episodes: no curated prompt behind them (environments generate them), audited
# for benchmark items, held-out seeds and the loss mask of the trajectories trained on them
AGENT_TABLE = "agent_tasks"
AUDITED_TABLES = (*SIDE_OF_TABLE, AGENT_TABLE)
ID_COLUMN = {"sft_data": "source_id", "dpo_pairs": "prompt_id", "rl_prompts": "prompt_id", "judge_data": "source_id"}
DECONTAM_STAGE = "curate.decontam"


@dataclass
class AuditCheck:
    name: str
    checked: int = 0
    offending: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.offending

    def flag(self, what: str) -> None:
        self.offending.append(what)


@dataclass
class AuditReport:
    checks: list[AuditCheck]
    snapshots: dict[str, str]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def violations(self) -> int:
        return sum(len(c.offending) for c in self.checks)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"violations": float(self.violations)}
        for c in self.checks:
            out[f"{c.name}.checked"] = float(c.checked)
            out[f"{c.name}.violations"] = float(len(c.offending))
        return out

    def as_dict(self) -> dict:
        return {"passed": self.passed, "violations": self.violations, "snapshots": self.snapshots,
                "checks": [{"name": c.name, "checked": c.checked, "violations": len(c.offending),
                            "offending": c.offending[:MAX_LISTED]} for c in self.checks]}

    def describe(self) -> str:
        lines = []
        for c in self.checks:
            status = "ok" if c.passed else f"{len(c.offending)} violation(s)"
            lines.append(f"{c.name}: {c.checked} checked, {status}")
            lines += [f"  - {o}" for o in c.offending[:MAX_LISTED]]
            if len(c.offending) > MAX_LISTED:
                lines.append(f"  ... and {len(c.offending) - MAX_LISTED} more")
        return "\n".join(lines)


class AuditFailed(RuntimeError):
    def __init__(self, report: AuditReport):
        self.report = report
        super().__init__(f"training-data audit failed with {report.violations} violation(s):\n{report.describe()}")


def _handed(wh: Warehouse, name: str, snapshots: dict[str, str],
            sources: Mapping[str, TableRef] | None = None) -> pl.DataFrame:
    """``name`` at the snapshot handed over in ``sources``, else its newest (recorded in ``snapshots``)."""
    ref = wh.pinned(name, sources)
    if ref is None:
        return pl.DataFrame()
    snapshots[name] = str(ref)
    return wh.read(name, ref.snapshot)


def _union(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The rows of ``frames`` (snapshots of one table), each row once."""
    if not frames:
        return pl.DataFrame()
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed").unique(maintain_order=True)


def _record(snapshots: dict[str, str], refs: list[TableRef]) -> None:
    """Name the snapshots of one table the audit read (the report's ``snapshots``)."""
    if refs:
        snapshots[refs[0].name] = ", ".join(str(r) for r in refs)


def _read_all(wh: Warehouse, refs: list[TableRef], snapshots: dict[str, str]) -> pl.DataFrame:
    """The rows of every snapshot in ``refs`` (one table), each row once."""
    _record(snapshots, refs)
    return _union([wh.read_ref(r) for r in refs])


def _add_snapshot(wh: Warehouse, out: dict[str, list[TableRef]], ref: TableRef, check: AuditCheck,
                  missing: str) -> None:
    """Add ``ref`` to ``out`` (once) when it is a training table's snapshot this warehouse holds;
    flag ``missing`` when it is not held."""
    if ref.name not in out:
        return
    check.checked += 1
    try:
        wh.ref(ref.name, ref.snapshot)
    except KeyError:
        check.flag(missing)
        return
    if all(r.snapshot != ref.snapshot for r in out[ref.name]):
        out[ref.name].append(TableRef(ref.name, ref.snapshot))


def _audited_snapshots(wh: Warehouse, sources: Mapping[str, TableRef] | None = None
                       ) -> tuple[dict[str, list[TableRef]], AuditCheck]:
    """Training table -> the snapshots to audit (what the newest model of each stage trained on,
    then the table's newest: both as of the snapshots handed over in ``sources``), and the check
    that they exist."""
    check = AuditCheck("training_snapshots")
    out: dict[str, list[TableRef]] = {name: [] for name in AUDITED_TABLES}
    models = read_models(wh, sources)
    if not models.is_empty():
        for row in models.group_by("stage", maintain_order=True).last().iter_rows(named=True):
            for text in json.loads(row["data_snapshots"] or "[]"):
                ref = TableRef.parse(text)
                _add_snapshot(wh, out, ref, check,
                              f"model {row['model_id']} trained on {ref}, which this warehouse no longer holds")
    for name, refs in out.items():
        latest = wh.pinned(name, sources)
        if latest is not None and all(r.snapshot != latest.snapshot for r in refs):
            refs.append(TableRef(name, latest.snapshot))
            check.checked += 1
    if not any(out.values()):
        check.flag(f"no training table ({', '.join(AUDITED_TABLES)}) in {wh.home}: nothing trained to audit")
    return out, check


def _scoped_snapshots(wh: Warehouse, scope: dict[str, list[TableRef]]) -> tuple[dict[str, list[TableRef]], AuditCheck]:
    """Training table -> exactly the snapshots in ``scope`` (what one model trained on), and the
    check that they exist."""
    check = AuditCheck("training_snapshots")
    out: dict[str, list[TableRef]] = {name: [] for name in AUDITED_TABLES}
    for refs in scope.values():
        for ref in refs:
            _add_snapshot(wh, out, ref, check, f"{ref} is not in this warehouse")
    if not any(out.values()):
        check.flag(f"no training snapshot ({', '.join(AUDITED_TABLES)}) to audit in {wh.home}")
    return out, check


def model_scope(wh: Warehouse, trained_on: list[TableRef], init_model: str) -> dict[str, list[TableRef]]:
    """What a model saw: the snapshots it trained on (``trained_on``) and those every registered
    model in its starting lineage trained on (the ``models`` row whose path is ``init_model``, then
    that row's own ``init_model``, back to the base), by training table. A stage that passed its
    initial model through unchanged (``models.path == init_model``) adds nothing."""
    out: dict[str, list[TableRef]] = {}
    for ref in trained_on:
        out.setdefault(ref.name, []).append(ref)
    models = read_models(wh)
    seen: set[str] = set()
    path = wh.local_path(init_model)
    while not models.is_empty() and path not in seen:
        seen.add(path)
        # the stage that wrote these weights (a stage with no rows in its range passes its initial
        # model through under its own row, same path: that row trained nothing)
        rows = models.filter((pl.col("path") == path) & (pl.col("init_model") != path))
        if rows.is_empty():
            break
        row = rows.row(-1, named=True)
        for text in json.loads(row["data_snapshots"] or "[]"):
            ref = TableRef.parse(text)
            if ref.name in AUDITED_TABLES and all(r.snapshot != ref.snapshot for r in out.setdefault(ref.name, [])):
                out[ref.name].append(ref)
        path = str(row["init_model"])
    return out


def _sources(wh: Warehouse, built_from: dict[TableRef, list[TableRef]], name: str,
             snapshots: dict[str, str]) -> pl.DataFrame:
    """``name`` as the audited training snapshots were built from it (every snapshot of it their
    lineage, ``built_from``, names), else its newest."""
    named = list(dict.fromkeys(p for parents in built_from.values() for p in parents if p.name == name))
    return _read_all(wh, named, snapshots) if named else _handed(wh, name, snapshots)


def _normalized(df: pl.DataFrame, column: str = "prompt") -> list[str]:
    """The column's texts normalized as curation does, in one vectorized pass."""
    return normalize_texts(df[column]) if not df.is_empty() else []


@dataclass
class SideRow:
    table: str
    prompt: str          # normalized
    cluster: str


def _side_index(pools: dict[str, pl.DataFrame], synthetic: pl.DataFrame) -> dict[str, dict[str, SideRow]]:
    """side -> id -> where the row lives, its normalized prompt hash and its cluster."""
    index: dict[str, dict[str, SideRow]] = {"sft": {}, "rl": {}}
    for side, name in POOL_TABLES.items():
        df = pools[name]
        for r, prompt in zip(df.iter_rows(named=True), _normalized(df)):
            index[side][str(r["id"])] = SideRow(name, prompt, f"pool:{r['cluster_id']}")
    for r, prompt in zip(synthetic.iter_rows(named=True), _normalized(synthetic)):
        side = r.get("split")
        if side in index:
            index[side][str(r["id"])] = SideRow("synthetic_tasks", prompt, f"synth:{r['cluster_id']}")
    return index


def _same_prompt(row: dict, prompt: str, home: SideRow) -> bool:
    """The training prompt (``prompt``, normalized) is the curated one; a GenRM judge example
    quotes it inside its judge prompt (tasks.train.judge_data: a synthetic instance's, or an open
    SFT-pool prompt's for the open pairs), so it must contain it instead."""
    if row.get("domain") == JUDGE_DOMAIN:
        return home.prompt in prompt
    return prompt == home.prompt


def _check_side(table: str, df: pl.DataFrame, prompts: list[str],
                index: dict[str, dict[str, SideRow]]) -> AuditCheck:
    side = SIDE_OF_TABLE[table]
    check = AuditCheck(f"{table.split('_')[0]}_side")
    for r, prompt in zip(df.iter_rows(named=True), prompts):
        check.checked += 1
        pid = str(r[ID_COLUMN[table]])
        home = index[side].get(pid)
        if home is None:
            other = "rl" if side == "sft" else "sft"
            where = f"the {other} side" if pid in index[other] else "no pool or synthetic instance"
            check.flag(f"{table} {r['source_table']}:{pid} comes from {where}")
        elif home.table != r["source_table"]:
            check.flag(f"{table} {pid} claims {r['source_table']} but lives in {home.table}")
        elif not _same_prompt(r, prompt, home):
            check.flag(f"{table} {pid}: prompt differs from the curated {home.table} text")
    return check


def _training_rows(tables: dict[str, pl.DataFrame],
                   prompts: dict[str, list[str]]) -> dict[str, list[tuple[str, str, str]]]:
    """side -> [(table, id, hash of the normalized prompt)] of every training row."""
    out: dict[str, list[tuple[str, str, str]]] = {"sft": [], "rl": []}
    for table, df in tables.items():
        for r, prompt in zip(df.iter_rows(named=True), prompts[table]):
            out[SIDE_OF_TABLE[table]].append((table, str(r[ID_COLUMN[table]]), text_hash(prompt)))
    return out


def _check_both_sides(rows: dict[str, list[tuple[str, str, str]]], index: dict[str, dict[str, SideRow]],
                      pools: dict[str, pl.DataFrame], synthetic: pl.DataFrame) -> list[AuditCheck]:
    prompts, clusters = AuditCheck("no_prompt_on_both_sides"), AuditCheck("no_cluster_on_both_sides")
    ids = {side: {pid for _, pid, _ in rs} for side, rs in rows.items()}
    texts = {side: {h: pid for _, pid, h in rs} for side, rs in rows.items()}
    prompts.checked = len(ids["sft"] | ids["rl"])
    for pid in sorted(ids["sft"] & ids["rl"]):
        prompts.flag(f"prompt {pid} trains on both sides")
    for h in sorted(set(texts["sft"]) & set(texts["rl"])):
        prompts.flag(f"the same prompt text trains on both sides (sft {texts['sft'][h]}, rl {texts['rl'][h]})")
    # clusters: of the training rows, and of the pools and synthetic splits they come from
    used = {side: {index[side][pid].cluster for pid in ids[side] if pid in index[side]} for side in ids}
    available: dict[str, set[str]] = {"sft": set(), "rl": set()}
    for side, name in POOL_TABLES.items():
        if not pools[name].is_empty():
            available[side] |= {f"pool:{c}" for c in pools[name]["cluster_id"].to_list()}
    if not synthetic.is_empty():
        for side in available:
            available[side] |= {f"synth:{c}" for c in synthetic.filter(pl.col("split") == side)["cluster_id"].to_list()}
    clusters.checked = len(available["sft"] | available["rl"])
    for c in sorted((used["sft"] & used["rl"]) | (available["sft"] & available["rl"])):
        clusters.flag(f"cluster {c} is on both sides")
    return [prompts, clusters]


def _benchmark_index(benchmarks: pl.DataFrame) -> dict[str, str]:
    """Hash of each benchmark item's normalized text -> ``benchmark:item_id``."""
    bench: dict[str, str] = {}
    for r, text in zip(benchmarks.iter_rows(named=True), _normalized(benchmarks, "text")):
        bench.setdefault(text_hash(text), f"{r['benchmark']}:{r['item_id']}")
    return bench


def _check_agent(wh: Warehouse, tasks: pl.DataFrame, benchmarks: pl.DataFrame, snapshots: dict[str, str],
                 sources: Mapping[str, TableRef] | None) -> list[AuditCheck]:
    """The agent stage's episodes and what it trained on them: no episode opens with a benchmark
    item, no training seed lies in the held-out range, and in every trajectory of those episodes
    the loss mask is 1 exactly on the policy's own sampled turns (never on the prompt, a tool's
    output or the environment's text)."""
    from data_specs.agents import HELDOUT_SEED_BASE

    items, seeds, masks = AuditCheck("agent_no_benchmark_item"), AuditCheck("agent_heldout_seeds"), \
        AuditCheck("trajectory_loss_mask")
    if tasks.is_empty():
        return [items, seeds, masks]
    bench = _benchmark_index(benchmarks)
    for r, prompt in zip(tasks.iter_rows(named=True), _normalized(tasks)):
        items.checked += 1
        seeds.checked += 1
        if (item := bench.get(text_hash(prompt))) is not None:
            items.flag(f"agent_tasks {r['task_id']} opens with benchmark item {item}")
        if r["seed"] >= HELDOUT_SEED_BASE:
            seeds.flag(f"agent_tasks {r['task_id']}: seed {r['seed']} is a held-out evaluation seed")
    ref = wh.pinned("trajectories", sources)
    if ref is None:
        return [items, seeds, masks]
    snapshots["trajectories"] = str(ref)
    ids = tasks["task_id"].to_list()
    trajectories = wh.scan("trajectories", ref.snapshot).filter(pl.col("task_id").is_in(ids)).select(
        "trajectory_id", "loss_mask", "turn_spans", "prompt_tokens").collect()
    for r in trajectories.iter_rows(named=True):
        masks.checked += 1
        trained = {i for start, end, *_ in json.loads(r["turn_spans"]) for i in range(start, end)}
        marked = {i for i, m in enumerate(r["loss_mask"]) if m}
        if marked != trained or any(i < r["prompt_tokens"] for i in marked):
            masks.flag(f"trajectory {r['trajectory_id']}: {len(marked - trained)} token(s) outside the policy's "
                       f"turns carry loss")
    return [items, seeds, masks]


def _check_benchmarks(rows: dict[str, list[tuple[str, str, str]]], benchmarks: pl.DataFrame,
                      decisions: pl.DataFrame) -> AuditCheck:
    check = AuditCheck("no_benchmark_item")
    bench = _benchmark_index(benchmarks)
    matched = {}
    if not decisions.is_empty():
        for r in decisions.filter(pl.col("stage") == DECONTAM_STAGE).iter_rows(named=True):
            matched[str(r["row_id"])] = r["reference_id"] or r["reason"]
    for side_rows in rows.values():
        for table, pid, prompt_hash in side_rows:
            check.checked += 1
            item = bench.get(prompt_hash)
            if item is not None:
                check.flag(f"{table} {pid} is benchmark item {item}")
            elif pid in matched:
                check.flag(f"{table} {pid} was matched to benchmark {matched[pid]} by decontamination")
    return check


def _check_rl_difficulty(wh: Warehouse, rl: dict[TableRef, pl.DataFrame], built_from: dict[TableRef, list[TableRef]],
                         snapshots: dict[str, str], require_difficulty: bool = True) -> AuditCheck:
    """Each audited ``rl_prompts`` snapshot (``rl``: its rows) against the difficulty decisions it
    was built from (the newest decision per prompt as of that build). ``require_difficulty``
    off (``train.data.rl_requires_difficulty: false``): an undecided prompt may train, a rejected
    one still may not."""
    check = AuditCheck("rl_latest_difficulty_keep")
    seen: list[str] = []
    for ref, rows in rl.items():
        named = [p for p in built_from[ref] if p.name == "difficulty"]
        difficulty_ref = named[-1] if named else wh.latest("difficulty")
        if difficulty_ref is not None:
            seen.append(str(difficulty_ref))
        latest = latest_decisions(wh.read_ref(difficulty_ref)) if difficulty_ref is not None else {}
        for r in rows.iter_rows(named=True):
            check.checked += 1
            decision = latest.get(str(r["prompt_id"]))
            if decision not in ("keep", "unscored") and (require_difficulty or decision is not None):
                check.flag(f"{ref} {r['prompt_id']}: latest difficulty decision "
                           f"({difficulty_ref or 'none'}) is {decision or 'missing'}")
    if seen:
        snapshots["difficulty"] = ", ".join(dict.fromkeys(seen))
    return check


def _check_sampled_targets(sft: pl.DataFrame, dpo: pl.DataFrame, teacher: pl.DataFrame,
                           rollouts: pl.DataFrame) -> AuditCheck:
    """Every sampled target is a verified sample of its own prompt: an SFT teacher target is a
    kept ``teacher_samples`` row of that prompt with that text; a DPO side said to be a rollout is
    a ``rollouts`` sample of that prompt, verified right (chosen) or wrong (rejected)."""
    check = AuditCheck("sampled_targets_verified")
    kept = {}
    if not teacher.is_empty():
        for r in teacher.filter(pl.col("kept")).iter_rows(named=True):
            kept[r["rollout_id"]] = (r["prompt_id"], r["text"])
    if not sft.is_empty() and "response_source" in sft.columns:
        for r in sft.filter(pl.col("response_source") == "teacher").iter_rows(named=True):
            check.checked += 1
            if kept.get(r["sample_id"]) != (str(r["source_id"]), r["response"]):
                check.flag(f"sft_data {r['example_id']}: its teacher target is not a kept teacher sample of "
                           f"prompt {r['source_id']} ({r['sample_id']})")
    rewards: dict[tuple[str, str], list[float]] = {}
    if not rollouts.is_empty():
        for pid, text, reward in rollouts.select("prompt_id", "text", "reward").iter_rows():
            rewards.setdefault((str(pid), text), []).append(reward)
    for r in dpo.iter_rows(named=True) if not dpo.is_empty() else ():
        for side, source, ok in (("chosen", "rollout_correct", lambda x: x >= 1.0),
                                 ("rejected", "rollout_wrong", lambda x: x <= 0.0)):
            if r[f"{side}_source"] != source:
                continue
            check.checked += 1
            if not any(ok(x) for x in rewards.get((str(r["prompt_id"]), r[side]), [])):
                check.flag(f"dpo_pairs {r['pair_id']}: its {side} side is not a {source.split('_')[1]} "
                           f"sample of prompt {r['prompt_id']}")
    return check


def run_audit(wh: Warehouse, scope: dict[str, list[TableRef]] | None = None,
              require_difficulty: bool = True, sources: Mapping[str, TableRef] | None = None) -> AuditReport:
    """Every check over what the models trained on and the newest training tables (or, with
    ``scope``, over exactly those snapshots: what one model saw, ``model_scope``), each against the
    snapshots it was built from; nothing is written. ``require_difficulty``: the training config's
    ``data.rl_requires_difficulty`` (off: RL prompts no difficulty run decided may train).
    ``sources``: the snapshots handed over (the pipeline's stages' outputs) to read instead of
    each table's newest: the models, training tables, benchmarks and decisions."""
    snapshots: dict[str, str] = {}
    audited, present = _audited_snapshots(wh, sources) if scope is None else _scoped_snapshots(wh, scope)
    # each audited snapshot's rows and lineage, read once
    frames = {ref: wh.read_ref(ref) for refs in audited.values() for ref in refs}
    built_from = {ref: wh.parents(ref.name, ref.snapshot) for ref in frames}
    pools = {name: _sources(wh, built_from, name, snapshots) for name in POOL_TABLES.values()}
    synthetic = _sources(wh, built_from, "synthetic_tasks", snapshots)
    if not synthetic.is_empty() and "split" not in synthetic.columns:
        raise ValueError(f"{snapshots['synthetic_tasks']} has no 'split' column: re-run `posttrain synthesize`")
    for refs in audited.values():
        _record(snapshots, refs)
    agent_tasks = _union([frames[r] for r in audited.pop(AGENT_TABLE, [])])
    tables = {name: _union([frames[r] for r in refs]) for name, refs in audited.items()}
    index = _side_index(pools, synthetic)
    prompts = {name: _normalized(df) for name, df in tables.items()}
    rows = _training_rows(tables, prompts)
    checks = [present]
    checks += [_check_side(name, df, prompts[name], index) for name, df in tables.items()]
    checks += _check_both_sides(rows, index, pools, synthetic)
    benchmarks = _handed(wh, "benchmarks", snapshots, sources)
    checks.append(_check_benchmarks(rows, benchmarks, _handed(wh, "decisions", snapshots, sources)))
    checks += _check_agent(wh, agent_tasks, benchmarks, snapshots, sources)
    checks.append(_check_rl_difficulty(wh, {r: frames[r] for r in audited["rl_prompts"]}, built_from, snapshots,
                                       require_difficulty))
    checks.append(_check_sampled_targets(tables["sft_data"], tables["dpo_pairs"],
                                         _sources(wh, built_from, "teacher_samples", snapshots),
                                         _sources(wh, built_from, "rollouts", snapshots)))
    return AuditReport(checks, snapshots)
