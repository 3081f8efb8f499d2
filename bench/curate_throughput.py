"""The whole curate run over N prompts / bare MiniLM encode of the same rows (curate's floor).

Corpus (seeded, offline): the bundled prompt sources (CHAMP, the open prompts, reasoning-gym
generators) topped up with synthetic word problems, some of them planted exact duplicates,
near-duplicates, rewordings, filter failures and copies of benchmark questions; benchmarks
are the bundled mmath and HumanEval items (538). Both sides run in this process with the
model already loaded (its load time is printed on its own line): the floor encodes every
prompt and every benchmark text once, as curate must at least do; curate is
``run_curate`` with the ``tiny`` profile's settings on a fresh warehouse, its blocks timed
through the ``step`` hook the flow uses. ``--flow`` times the curate flow instead (Prefect
tasks, the MLflow run and its plots; the first flow call also starts Prefect's temporary
server), its blocks from their task runs. Goal: curate / encode <= 1.5.

    .venv/bin/python bench/curate_throughput.py --rows 20000 [--flow]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import numpy as np

from tasks import sources
from tasks.curate import CurateConfig, run_curate
from tasks.curate.semantic import encode, load_model
from tasks.ingest import store_records
from tasks.profile import load_profile
from tasks.records import RawRecord
from warehouse import Warehouse

REASONING_GYM_TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "word_sorting", "letter_counting",
                       "spell_backward"]
NOUNS = ["farmer", "train", "river", "library", "robot", "garden", "bakery", "comet", "violin", "harbor",
         "orchard", "factory", "village", "school", "bridge", "ship", "market", "tower", "forest", "museum"]
THINGS = ["apples", "books", "bolts", "tickets", "stamps", "marbles", "coins", "bricks", "lamps", "seeds"]
VERBS = ["collects", "sells", "repairs", "orders", "counts", "ships", "paints", "stores", "measures", "trades"]
CLAUSES = ["Each morning it also receives {a} more {t} from a supplier.",
           "On weekends the amount doubles, but {a} {t} are always set aside.",
           "A second {n} nearby handles {a} {t} less than the first one.",
           "After every {a} days, a quarter of the stock is given away.",
           "The price of one of the {t} is {a} dollars."]
QUESTIONS = ["How many {t} does it have after {d} days?", "What is the total number of {t} after {d} days?",
             "How many {t} are left at the end of day {d}?"]


def word_problem(rng: np.random.Generator, i: int) -> dict:
    """A distinct math word problem with a numeric answer (row ``i`` appears in its text)."""
    n, v, t = rng.choice(NOUNS), rng.choice(VERBS), rng.choice(THINGS)
    clauses = [c.format(a=int(rng.integers(2, 90)), t=t, n=n) for c in rng.choice(CLAUSES, size=2, replace=False)]
    question = rng.choice(QUESTIONS).format(t=t, d=int(rng.integers(2, 40)))
    prompt = (f"A {n} with registry number {i} {v} {int(rng.integers(2, 999))} {t} per day. "
              f"{' '.join(clauses)} {question}")
    return {"prompt": prompt, "answer": str(int(rng.integers(1, 10_000))), "domain": "math"}


def planted_variant(rng: np.random.Generator, row: dict, bench_texts: list[str]) -> dict:
    """A copy of ``row`` that curate should catch (or a filter failure, or a benchmark copy)."""
    kind = rng.choice(["exact", "near", "reworded", "proof", "yes_no", "benchmark"],
                      p=[0.35, 0.25, 0.15, 0.08, 0.07, 0.10])
    prompt = row["prompt"]
    if kind == "exact":
        prompt = prompt.upper() if rng.random() < 0.5 else "  ".join(prompt.split())
    elif kind == "near":
        words = prompt.split()
        words[int(rng.integers(len(words) // 2, len(words)))] = "exactly"
        prompt = " ".join(words)
    elif kind == "reworded":
        prompt = prompt.replace("How many", "What number of").replace("per day", "each day")
    elif kind == "proof":
        prompt = "Prove that " + prompt[0].lower() + prompt[1:].rstrip("?") + " is always even."
    elif kind == "yes_no":
        return {**row, "prompt": prompt.replace("How many", "Are there more than 10"), "answer": "Yes"}
    else:
        return {"prompt": bench_texts[int(rng.integers(len(bench_texts)))], "answer": "1", "domain": "math"}
    return {**row, "prompt": prompt}


def synthetic_rows(count: int, bench_texts: list[str], seed: int = 0, planted: float = 0.2) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for i in range(count):
        if rows and rng.random() < planted:
            rows.append(planted_variant(rng, rows[int(rng.integers(len(rows)))], bench_texts))
        else:
            rows.append(word_problem(rng, i))
    return rows


def build_corpus(wh: Warehouse, rows: int, per_task: int) -> list[str]:
    """Stores prompts (bundled + synthetic, ``rows`` in all) and benchmarks; returns the benchmark texts."""
    for bench, recs in sources.mmath_records().items():
        store_records(wh, recs, bench, kind="benchmarks")
    store_records(wh, sources.humaneval_records(), "humaneval", kind="benchmarks")
    bench_texts = wh.read("benchmarks")["text"].to_list()
    bundled = {"champ": sources.champ_records(), "open_prompts": sources.open_prompt_records(),
               "reasoning_gym": list(sources.reasoning_gym_records(REASONING_GYM_TASKS, per_task, seed=0))}
    for name, recs in bundled.items():
        store_records(wh, recs, name)
    short_items = [t for t in bench_texts if len(t) < 400]
    for seed in range(10):   # copies of one row (same id) are stored once: top up to exactly ``rows``
        have = wh.read("prompts").height
        if have >= rows:
            break
        fill = synthetic_rows(rows - have, short_items, seed=seed)
        store_records(wh, [RawRecord(f"synthetic{seed}.jsonl", i + 1, data=r) for i, r in enumerate(fill)],
                      "synthetic")
    return bench_texts


class Clock:
    """Wall and CPU seconds (this process, all threads) since creation.

    Other jobs on a shared machine stretch wall time; CPU time is what this process used.
    """
    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def timed_steps(times: dict[str, list[float]]):
    """A ``step`` hook for run_curate that records each block's (wall, CPU) seconds."""
    def step(name: str, fn):
        clock = Clock()
        try:
            return fn()
        finally:
            times[name] = [a + b for a, b in zip(times.get(name, [0.0, 0.0]), clock.read())]
    return step


def bare_encode_seconds(texts: list[str], cfg: CurateConfig) -> tuple[float, float]:
    clock = Clock()
    encode(texts, cfg.semantic)
    return clock.read()


def flow_block_seconds(mlflow_run_id: str, home: str) -> dict[str, list[float]]:
    """Wall seconds per block of a curate flow run, from its Prefect task runs (no CPU time there)."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks import tracking
    tracking.configure(home=home)
    flow_run_id = MlflowClient().get_run(mlflow_run_id).data.tags["prefect.flow_run_id"]
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0].removeprefix("curate."): [(r.end_time - r.start_time).total_seconds(),
                                                                float("nan")]
            for r in sorted(runs, key=lambda r: r.start_time)}


def run_once(wh: Warehouse, home: str, cfg: CurateConfig, args) -> tuple[dict, dict, tuple[float, float]]:
    """(counters, {block: [wall, CPU]}, (wall, CPU) of the whole run): ``run_curate``, or the curate flow."""
    times: dict[str, list[float]] = {}
    clock = Clock()
    if not args.flow:
        result = run_curate(wh, cfg, step=timed_steps(times))
        return result.counters, times, clock.read()
    from flows.curate import curate_flow
    out = curate_flow(profile=args.profile, home=home)
    total = clock.read()
    return out, flow_block_seconds(out["mlflow_run_id"], home), total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--per-task", type=int, default=1000, help="rows per reasoning-gym generator")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--flow", action="store_true", help="time the curate flow (Prefect tasks, MLflow logging) "
                                                        "instead of run_curate")
    args = ap.parse_args()
    cfg = load_profile(args.profile).section("curate", CurateConfig)
    clock = Clock()
    load_model(cfg.semantic)
    load_s = clock.read()[0]
    with tempfile.TemporaryDirectory() as home:
        wh = Warehouse(home)
        bench_texts = build_corpus(wh, args.rows, args.per_task)
        texts = wh.read("prompts")["prompt"].to_list() + bench_texts
        encode(texts[:64], cfg.semantic)              # warm-up outside both timings
        floors = [bare_encode_seconds(texts, cfg)]
        counters, times, curate = run_once(wh, home, cfg, args)
        floors.append(bare_encode_seconds(texts, cfg))
    # the floor is measured before and after curate: their mean brackets load changes on a shared machine
    floor = tuple(sum(f[i] for f in floors) / len(floors) for i in range(2))
    report(args, counters, times, curate, floor, floors, load_s, len(bench_texts))


def report(args, c, times, curate, floor, floors, load_s, n_bench) -> None:
    print(f"prompts={c['rows_new']:.0f} benchmarks={n_bench} profile={args.profile} "
          f"{'curate flow' if args.flow else 'run_curate'}  kept: sft={c['sft_pool']:.0f} rl={c['rl_pool']:.0f} "
          f"removed={c['removed']:.0f}  encoded: prompts={c['encoded']:.0f} benchmarks={c['encoded_benchmarks']:.0f}")
    print(f"model load (once per process, outside both timings): {load_s:.1f}s")
    print(f"bare MiniLM encode of all {c['rows_new'] + n_bench:.0f} texts: wall {floor[0]:.1f}s, CPU {floor[1]:.1f}s "
          f"(before curate: {floors[0][0]:.1f}s / {floors[0][1]:.1f}s, after: {floors[1][0]:.1f}s / {floors[1][1]:.1f}s)")
    print(f"{'block':16s} {'wall s':>8s} {'CPU s':>8s} {'share':>6s}")
    for name, (wall, cpu) in times.items():
        print(f"{name:16s} {wall:8.2f} {cpu:8.2f} {wall / curate[0]:6.1%}")
    outside = [curate[i] - sum(t[i] for t in times.values()) for i in range(2)]   # CPU: nan in flow mode
    print(f"{'(outside blocks)':16s} {outside[0]:8.2f} {outside[1]:8.2f} {outside[0] / curate[0]:6.1%}  "
          "(loading rows, writing tables" + (", Prefect and MLflow)" if args.flow else ")"))
    print(f"{'curate total':16s} {curate[0]:8.2f} {curate[1]:8.2f}")
    print(f"ratio curate/encode = {curate[0] / floor[0]:.2f} wall, {curate[1] / floor[1]:.2f} CPU  (goal <= 1.5)")


if __name__ == "__main__":
    main()
