"""GenRM judge examples inside SFT: the policy learns the verdict format on pairs it can check.

For SFT-side synthetic instances, the gold answer and a verifier-rejected perturbation
become Answer 1 / Answer 2 of the judge's own pairwise prompt (``tasks.genrm.prompts``,
through ``tasks.genrm.synthetic``), and the response is the verdict the parser reads back
(``[[-1]]``: Answer 1 better, ``[[1]]``: Answer 2 better). Within a task the gold's slot
alternates over a seeded shuffle of the instances: both orders, balanced, so position
alone never predicts the verdict.

Rows are shaped like every other ``sft_data`` source row, with ``domain = "judge"``,
``source_table = "synthetic_tasks"`` and ``source_id`` the instance the pair came from;
their prompt *contains* the instance's prompt instead of equalling it.
"""
from __future__ import annotations

import random

from tasks.genrm.config import JudgeConfig
from tasks.genrm.synthetic import judge_pair, judge_response

JUDGE_DOMAIN = "judge"
# candidates and question are shown whole: tiny prompts are far below the default cut
DEFAULT_MAX_CHARS = JudgeConfig().max_response_chars


def judge_sft_rows(rows: dict[str, dict], per_task: int, seed: int,
                   max_chars: int = DEFAULT_MAX_CHARS) -> list[dict]:
    """Up to ``per_task`` judge examples per synthetic task from side rows (``side_rows``)."""
    if per_task <= 0:
        return []
    from tasks.synth.registry import get_task
    from tasks.verify.registry import synth_instance

    by_task: dict[str, list[dict]] = {}
    for pid, r in rows.items():
        if r.get("_table") == "synthetic_tasks" and r.get("task"):
            by_task.setdefault(str(r["task"]), []).append({**r, "_id": pid})
    out: list[dict] = []
    for name in sorted(by_task):
        try:
            task = get_task(name)
        except Exception:  # noqa: BLE001, S112 - an unknown task just yields no judge examples
            continue
        candidates = sorted(by_task[name], key=lambda r: r["_id"])
        rng = random.Random(f"judge:{seed}:{name}")
        rng.shuffle(candidates)
        made = 0
        for r in candidates:
            if made >= per_task:
                break
            try:
                instance = synth_instance(r)
                pair = judge_pair(task, instance, gold_second=made % 2 == 1, rng=rng)
            except Exception:  # noqa: BLE001 - a row that cannot be rebuilt is skipped
                pair = None
            if pair is None:
                continue
            out.append({"source_table": "synthetic_tasks", "source_id": r["_id"], "domain": JUDGE_DOMAIN,
                        "prompt": pair.prompt(max_chars), "response": judge_response(pair.gold, pair.label)})
            made += 1
    return out
