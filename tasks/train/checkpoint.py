"""Checkpoints under ``$POSTTRAIN_HOME/checkpoints/<run>/<stage>/``.

Layout of a stage directory:
    job.json           what the stage was asked to do (and its input fingerprint)
    ds/                DeepSpeed checkpoints (``step_00000010/`` ...) and ``latest``
    steps.jsonl        one line per optimizer step: loss, metrics, the example ids seen
    final/             the Hugging Face model, written last, with ``DONE`` beside it

``latest`` names the newest complete checkpoint. It is written here, not by DeepSpeed:
DeepSpeed's own truncates the file and then writes the tag, on rank 0 before its closing
barrier, so a kill at that moment left an empty pointer (the stage then lost every
checkpoint) or one to a checkpoint whose other ranks were still writing. Rank 0 replaces it
atomically after every rank has saved, so a stage killed mid-save resumes from the previous
one. The per-step log is cut back to the
checkpoint's step on resume, so the curve continues without duplicated steps.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

DONE_MARKER = "DONE"


def stage_dir(checkpoints_root: Path, run_name: str, stage: str) -> Path:
    return Path(checkpoints_root) / run_name / stage


def ds_dir(stage_path: Path) -> Path:
    return stage_path / "ds"


def final_dir(stage_path: Path) -> Path:
    return stage_path / "final"


def is_done(stage_path: Path) -> bool:
    return (stage_path / DONE_MARKER).exists()


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: a kill mid-write never leaves it cut."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_step(stage_path: Path) -> int | None:
    latest = ds_dir(stage_path) / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    return int(tag.rsplit("_", 1)[-1]) if tag.startswith("step_") else None


def save(engine, stage_path: Path, step: int, client_state: dict, keep: int, is_rank0: bool) -> None:
    """Collective: every rank calls it. Keeps the newest ``keep`` checkpoints."""
    root = ds_dir(stage_path)
    state = {**client_state, "step": step, "torch_rng": torch.get_rng_state()}
    tag = f"step_{step:08d}"
    # every rank has saved when save_checkpoint returns (it ends on a barrier)
    engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
    if is_rank0:
        write_atomic(root / "latest", tag)
        tags = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load(engine, stage_path: Path) -> dict | None:
    """Load the latest checkpoint into ``engine``; its client state, or None when there is none."""
    if latest_step(stage_path) is None:
        return None
    path, client_state = engine.load_checkpoint(str(ds_dir(stage_path)))
    if path is None:
        return None
    if client_state and "torch_rng" in client_state:
        torch.set_rng_state(client_state["torch_rng"])
    return client_state or {}


class StepLog:
    """Append-only JSON lines of per-step records, written by rank 0."""

    def __init__(self, stage_path: Path, enabled: bool):
        self.path = stage_path / "steps.jsonl"
        self.enabled = enabled

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a line cut by a kill: everything after it is gone too
        return out

    def truncate_after(self, step: int) -> list[dict]:
        """Keep records up to ``step`` (the resumed checkpoint) and return them."""
        kept = [r for r in self.records() if r["step"] <= step]
        if self.enabled:
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()


@contextlib.contextmanager
def _whole(module, zero_stage: int) -> Iterator[None]:
    """While open, every rank's ``module`` holds whole parameters (a collective under ZeRO-3,
    where they are sharded; nothing to do below it)."""
    if zero_stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def save_hf(engine, tokenizer, out_dir: Path, zero_stage: int, is_rank0: bool) -> None:
    """Final weights in Hugging Face format (collective under ZeRO-3, where params are sharded)."""
    with _whole(engine.module, zero_stage):
        if is_rank0:
            _write_hf(engine.module, tokenizer, out_dir)


def state_dict_bytes(engine, zero_stage: int, is_rank0: bool) -> bytes | None:
    """The module's weights as one safetensors blob on rank 0, None on the others (a collective
    under ZeRO-3, where params are sharded): a weight push without a file. A tensor sharing its
    storage with one before it (a tied weight) is sent once, as ``save_pretrained`` does."""
    with _whole(engine.module, zero_stage):
        return _state_blob(engine.module) if is_rank0 else None


def _state_blob(module) -> bytes:
    from safetensors.torch import save

    tensors, seen = {}, set()
    for name, tensor in module.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    return save(tensors)


def _write_hf(module, tokenizer, out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def mark_done(stage_path: Path, summary: dict) -> None:
    (stage_path / DONE_MARKER).write_text(json.dumps(summary, indent=2, default=str))


def read_done(stage_path: Path) -> dict:
    return json.loads((stage_path / DONE_MARKER).read_text())
