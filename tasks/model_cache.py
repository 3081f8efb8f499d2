"""Models built once and cached under ``$POSTTRAIN_HOME/models/<name>/``.

Building (converting a GGUF, training a tokenizer, initializing weights) happens in a
temporary directory that is renamed into place when complete, under a file lock: a build
killed half way never leaves a directory that looks usable, and concurrent callers wait
for the first one instead of building twice.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from warehouse.paths import posttrain_home

COMPLETE_MARKERS = ("config.json", "tokenizer.json")


def models_root(home: str | Path | None = None) -> Path:
    root = posttrain_home(home) / "models"
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``root/name``, built by ``build(tmp_dir)`` if it is not there complete yet."""
    target = root / name
    with FileLock(str(root / f"{name}.lock")):
        if all((target / m).exists() for m in COMPLETE_MARKERS):
            return target
        tmp = root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)      # left by a build that was killed
        shutil.rmtree(target, ignore_errors=True)   # incomplete
        build(tmp)
        tmp.rename(target)
    return target


def model_identity(model: str) -> str:
    """What names a model's weights: for a checkpoint directory, its path and each file's size and
    modification time (a stage trained again on new data rewrites the same path); else the name."""
    path = Path(model)
    if not path.is_dir():
        return model
    files = sorted((f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in path.rglob("*") if f.is_file())
    return f"{model}#{hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]}"
