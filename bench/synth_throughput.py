"""Synthesis throughput: instances per second for every own task family, the seconds its
uniqueness and solvability checks cost, and the same family's reasoning-gym counterpart (where
reasoning-gym has one) generated in the same process on the same levels' worth of draws.

Each family draws ``--per-level`` instances at every level (seeds as the synthesize stage derives
them), timed with the checks' own seconds added up by ``tasks.synth.base.uniqueness_check``. A
peer is its reasoning-gym dataset through the same adapter the pipeline uses (``rg:<dataset>``,
its curriculum levels), timed the same way, so the ratio compares generators and nothing else.

    .venv/bin/python bench/synth_throughput.py [--per-level 20] [--tasks sudoku zebra_puzzle] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# own family -> the reasoning-gym dataset that poses the same kind of puzzle
PEERS = {
    "sudoku": "sudoku", "futoshiki": "futoshiki", "game_of_24": "countdown", "cryptarithm": "cryptarithm",
    "word_sorting": "word_sorting", "zebra_puzzle": "zebra_puzzles", "buckets": "jugs",
    "boolean_expressions": "propositional_logic", "web_of_lies": "knights_knaves",
    "object_counting": "leg_counting",
}


def time_task(name: str, per_level: int, seed: int = 0) -> dict:
    """Instances/s of ``name`` over ``per_level`` draws at each level, and its checks' share."""
    from tasks.synth.base import stable_int, uniqueness_seconds
    from tasks.synth.registry import get_task

    task = get_task(name)
    task.generate(stable_int("bench-warmup", name), 0)   # imports and caches outside the clock
    checks0, t0 = uniqueness_seconds(), time.perf_counter()
    per_level_s, failed = [], 0
    for level in range(task.n_levels):
        lt = time.perf_counter()
        for draw in range(per_level):
            try:
                task.generate(stable_int("synthesize", seed, name, level, draw), level)
            except Exception:  # noqa: BLE001 - a generator that gives up (reasoning-gym's countdown does) is counted
                failed += 1
        per_level_s.append(time.perf_counter() - lt)
    seconds = time.perf_counter() - t0
    n = per_level * task.n_levels - failed
    return {"task": name, "levels": task.n_levels, "instances": n, "failed": failed, "seconds": seconds,
            "per_second": n / seconds, "check_seconds": uniqueness_seconds() - checks0,
            "slowest_level_ms": 1000 * max(per_level_s) / per_level}


def _timed_in_child(name: str, per_level: int, queue) -> None:
    queue.put(time_task(name, per_level))


def time_task_within(name: str, per_level: int, limit_s: float) -> dict | None:
    """``time_task`` in a child process (each side the same way), None when it runs past
    ``limit_s`` (reasoning-gym's jugs takes over 30 s an instance from its third level)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_timed_in_child, args=(name, per_level, queue))
    child.start()
    try:
        return queue.get(timeout=limit_s)
    except Exception:  # noqa: BLE001 - queue.Empty: past the limit
        return None
    finally:
        child.terminate()
        child.join()


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from tasks.synth.registry import get_task, own_task_names

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-level", type=int, default=20, help="instances drawn at each level of each family")
    ap.add_argument("--tasks", nargs="*", default=None, help="own families to time (default: all)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--limit-s", type=float, default=120.0, help="give up on a family (or peer) after this long")
    args = ap.parse_args()

    console = Console()
    names = args.tasks or own_task_names()
    rows = []
    with console.status("timing...") as status:
        for name in names:
            status.update(f"timing {name}")
            row = time_task_within(name, args.per_level, args.limit_s)
            if row is None:
                console.print(f"{name}: gave up after {args.limit_s:.0f} s")
                continue
            if name in PEERS:
                status.update(f"timing rg:{PEERS[name]} (peer of {name})")
                peer = time_task_within(f"rg:{PEERS[name]}", args.per_level, args.limit_s)
                if peer is None:   # slower than the limit allows: ours is at least this many times faster
                    asked = args.per_level * get_task(f"rg:{PEERS[name]}").n_levels
                    row.update(peer=f"rg:{PEERS[name]}", peer_per_second=None, peer_failed=0,
                               ratio_at_least=row["per_second"] * args.limit_s / asked)
                else:
                    row.update(peer=peer["task"], peer_per_second=peer["per_second"], peer_failed=peer["failed"],
                               ratio=row["per_second"] / peer["per_second"])
            rows.append(row)

    table = Table(title=f"synthesis throughput ({args.per_level} instances per level, one thread)")
    for col in ("family", "levels", "inst/s", "checks s", "checks share", "slowest level ms/inst",
                "reasoning-gym peer", "peer inst/s", "ours / peer"):
        table.add_column(col, justify="left" if col in ("family", "reasoning-gym peer") else "right")
    for r in rows:
        table.add_row(r["task"], str(r["levels"]), f"{r['per_second']:.0f}", f"{r['check_seconds']:.2f}",
                      f"{r['check_seconds'] / r['seconds']:.0%}", f"{r['slowest_level_ms']:.1f}",
                      r.get("peer", "") + (f" ({r['peer_failed']} failed)" if r.get("peer_failed") else ""),
                      f"{r['peer_per_second']:.0f}" if r.get("peer_per_second") else
                      (f"> {args.limit_s:.0f} s" if "peer" in r else ""),
                      f"{r['ratio']:.2f}×" if "ratio" in r else
                      (f"≥ {r['ratio_at_least']:.0f}×" if "ratio_at_least" in r else ""))
    console.print(table)
    total_n = sum(r["instances"] for r in rows)
    total_s = sum(r["seconds"] for r in rows)
    checks = sum(r["check_seconds"] for r in rows)
    console.print(f"{len(rows)} families: {total_n} instances in {total_s:.1f} s ({total_n / total_s:.0f}/s); "
                  f"uniqueness and solvability checks {checks:.1f} s ({checks / total_s:.0%} of it)")
    paired = [r for r in rows if "ratio" in r]
    if paired:   # peers that ran past the limit are left out of the mean
        from statistics import geometric_mean
        console.print(f"against reasoning-gym on {len(paired)} paired families: geometric mean "
                      f"{geometric_mean(r['ratio'] for r in paired):.2f}× its instances/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
