"""The script each rank runs when a stage is started by ``torchrun`` / ``deepspeed`` (or alone
in a fresh process): ``python tasks/train/launcher_entry.py --job <stage dir>/job.json``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# launched as a script: make the repository importable before importing our packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.train.runner import StageJob, run_stage_here


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, type=Path, help="job.json written by execute_stage")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    run_stage_here(StageJob.load(args.job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
