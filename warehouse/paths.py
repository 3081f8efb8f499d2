"""Where posttrain keeps its data: ``$POSTTRAIN_HOME`` (default ``./.posttrain``)."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = ".posttrain"


def posttrain_home(home: str | os.PathLike | None = None) -> Path:
    path = Path(home) if home is not None else Path(os.environ.get("POSTTRAIN_HOME", DEFAULT_HOME))
    path = path.expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
