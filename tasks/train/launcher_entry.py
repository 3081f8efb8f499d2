"""The script each rank runs when a stage is started by ``torchrun`` / ``deepspeed`` (or alone
in a fresh process): ``python tasks/train/launcher_entry.py --job <stage dir>/job.json``.

A rank started for a pipeline (``$POSTTRAIN_LAUNCH_OWNER`` names it) never outlives it: it
asks for SIGKILL when its parent exits (Linux), and a watch thread ends its process group
once the pipeline's pid is gone, whichever launcher stands between them."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

# launched as a script: make the repository importable before importing our packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.train import proc  # standard library only: tie this rank first


def _tie_to_pipeline() -> None:
    owner = os.environ.get(proc.OWNER_ENV)
    if not owner:
        return   # started by hand: nobody to die with
    proc.set_parent_death_signal(signal.SIGKILL)

    def gone() -> None:
        # a rank leads its own group under torchrun (its children in it), the launcher's group
        # under the plain process launcher: either way nothing in it should outlive the pipeline
        print(f"posttrain: the pipeline that started this launcher ({owner}) is gone; "
              f"pid {os.getpid()} exits", file=sys.stderr, flush=True)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    proc.watch_owner(owner, on_gone=gone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, type=Path, help="job.json written by execute_stage")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    _tie_to_pipeline()
    from tasks.train.runner import StageJob, run_stage_here

    run_stage_here(StageJob.load(args.job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
