"""SFT steps with the FP32 head over the scored positions only vs over every position.

An SFT row scores its response: a few tokens after a prompt of tens to hundreds. The fused
head (``model.hybrid.FusedLogprobHead``) takes the vocabulary's two passes (forward, and the
backward's recomputation) only at positions whose label is scored; the peer is the same head
run over every position (what it did before 2026-12-02), patched in for its side only.

Both sides run the stage's own call (``response_logprobs`` then the token-normalized NLL and
backward) on the same model and the same micro-batches, padded as the stage pads them, on two
tables of a finished pipeline home: ``sft_data`` (the policy's sft_short rows, re-encoded as that
stage runs them) and ``judge_data`` (prefix-shared, as the judge stage runs). Sides alternate
micro-batch by micro-batch after a warm-up each; the median tokens/s is reported, with the largest
log-prob difference between the sides at the scored positions.

    .venv/bin/python bench/head_scored_positions.py --home .posttrain        # after `make run`
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@contextmanager
def head_over_every_position():
    """The peer: the head through the vocabulary at every position, as before the change."""
    from kernels import head_logprobs
    from model.hybrid import FusedLogprobHead

    scored_only = FusedLogprobHead.forward

    def every_position(self, hidden, labels=None, ignore_index=-100):
        if labels is None:   # logits: the head's own path, unchanged
            return scored_only(self, hidden)
        return head_logprobs(hidden, self.weight, labels, ignore_index)

    FusedLogprobHead.forward = every_position
    try:
        yield
    finally:
        FusedLogprobHead.forward = scored_only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished pipeline home (read only)")
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (tiny: 16)")
    ap.add_argument("--batches", type=int, default=12, help="timed micro-batches per side and table")
    args = ap.parse_args()

    import polars as pl
    import torch

    from warehouse import Warehouse

    torch.set_num_threads(1)
    wh = Warehouse(args.home)
    if not all(wh.exists(t) for t in ("sft_data", "judge_data", "models")):
        raise SystemExit(f"{args.home}: no sft_data, judge_data or models table; run the pipeline first (make run)")
    models = wh.read("models")
    # table, stage rows, the model that trains on them, max tokens and prefix sharing as in the tiny profile
    cases = [("sft_data", "sft_short", "sft_short", 160, False), ("judge_data", "judge", "judge", 512, True)]
    for table, stage, model_stage, max_tokens, shared in cases:
        data = wh.read(table).filter(pl.col("stage") == stage)
        path = models.filter(pl.col("stage") == model_stage)["path"]
        if data.height == 0 or path.len() == 0:
            print(f"{table}: no {stage} rows or model; skipped")
            continue
        print(f"{table} ({stage} rows, {'prefix-shared' if shared else 're-encoded'}): "
              + compare(path[-1], data, max_tokens, shared, args.micro, args.batches))


def compare(model_path: str, data, max_tokens: int, shared: bool, micro: int, batches: int) -> str:
    """One table: the stage's step on the same micro-batches, each head; the line to print."""
    import torch
    from prefix_shared_sft import alternating_tokens_per_second, sft_micro_batches

    from model.config import IGNORE_INDEX
    from model.loading import load_causal_lm
    from model.logprobs import response_logprobs
    from model.losses import sft_loss
    from tasks.train.encoding import pad_id_of

    model, tokenizer = load_causal_lm(model_path)
    model.train()
    pad = pad_id_of(tokenizer)
    padded = sft_micro_batches(data, tokenizer, micro, batches, max_tokens)

    def step(batch, every: bool) -> tuple[float, torch.Tensor]:
        mask = batch["labels"][:, 1:] != IGNORE_INDEX
        with head_over_every_position() if every else nullcontext():
            t0 = time.perf_counter()
            out = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["labels"],
                                    pad_id=pad, prefix_shared=shared)
            (sft_loss(out.logp, mask, "token") + out.aux).backward()
            seconds = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return seconds, out.logp.detach()[mask]

    diff = (step(padded[0], True)[1] - step(padded[0], False)[1]).abs().max()
    times = alternating_tokens_per_second(padded, lambda batch, every: step(batch, every)[0])
    total = sum(int(b["attention_mask"].sum()) for b in padded[1:])
    scored = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in padded[1:])
    mine, peer = statistics.median(times[False]), statistics.median(times[True])
    return (f"{len(padded) - 1} micro-batches of {micro}, {scored / total:.1%} of {total:,} tokens scored; "
            f"head over every position {peer:,.0f} tokens/s, scored positions only {mine:,.0f} tokens/s: "
            f"speed-up {mine / peer:.2f}x; max |dlogp| {float(diff):.1e}")


if __name__ == "__main__":
    main()
