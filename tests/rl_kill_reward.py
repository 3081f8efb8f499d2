"""A reward for the RL resume test, run inside a launcher-started stage: scores by the parity of
the first token and, when ``POSTTRAIN_TEST_KILL_STAGE`` names the stage directory, SIGKILLs its
own process once, at the first scoring after the stage's checkpoint at step ``KILL_AFTER_STEP``
exists (a ``kill -9`` in the middle of an asynchronous RL stage, at a point the test knows)."""
import os
import signal
from pathlib import Path

KILL_AFTER_STEP = 2


def parity_killed_once(row: dict, text: str, token_ids: list[int]) -> float:
    stage = os.environ.get("POSTTRAIN_TEST_KILL_STAGE")
    if stage:
        latest, marker = Path(stage) / "ds" / "latest", Path(stage) / "killed"
        if latest.exists() and latest.read_text().strip() == f"step_{KILL_AFTER_STEP:08d}" and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if token_ids and token_ids[0] % 2 == 0 else 0.0
