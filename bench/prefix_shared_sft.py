"""SFT steps with prefix sharing vs re-encoding every prompt, on the judge stage's own data.

The judge stage's examples (``judge_data``) all open with the same grading instructions, so
``prefix_shared`` groups each micro-batch's rows by their common start and encodes it once.
Both sides run the SFT stage's step on the same model, the same micro-batches (``--micro``
rows, padded as the stage pads them) and the same loss (token-normalized NLL, backward);
only the log-prob path differs (``prefix_shared_logprobs`` vs ``token_logprobs``). The
sides alternate micro-batch by micro-batch after a warm-up each, so load on the machine
hits both alike; the median over ``--batches`` micro-batches is reported. Before timing,
the per-token log-probs of the two paths are compared.

tokens/s counts the real tokens of each micro-batch (the same number for both sides), so the
ratio is the speed-up; ``forwarded`` is the share of them the shared path actually runs.

    .venv/bin/python bench/prefix_shared_sft.py --home .posttrain        # after `make run`
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def sft_micro_batches(data, tokenizer, micro: int, batches: int, max_tokens: int) -> list[dict]:
    """``batches`` + 1 micro-batches of ``micro`` rows sampled (seeded) from ``data``'s prompt and
    response columns, padded as an SFT stage pads them (the first is for warm-up and checks)."""
    from tasks.train.encoding import encode_example, pad_batch, pad_id_of

    pad = pad_id_of(tokenizer)
    sample = data.sample(n=min(micro * (batches + 1), data.height), seed=0, shuffle=True)
    encoded = [encode_example(tokenizer, p, r, d) for p, r, d in zip(sample["prompt"], sample["response"], sample["domain"])]
    return [pad_batch([e[0] for e in encoded[s:s + micro]], [e[1] for e in encoded[s:s + micro]], pad, max_tokens)
            for s in range(0, len(encoded) - micro + 1, micro)]


def alternating_tokens_per_second(batches: list[dict], run, sides=(True, False)) -> dict:
    """Each side's tokens/s on every batch but the first (``run(batch, side)`` returns seconds), the
    sides' order alternating batch by batch, so load on the machine hits both alike."""
    rates: dict = {side: [] for side in sides}
    for i, batch in enumerate(batches[1:]):
        real = int(batch["attention_mask"].sum())
        for side in (sides if i % 2 == 0 else sides[::-1]):
            rates[side].append(real / run(batch, side))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a finished pipeline home (read only)")
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (tiny: 16)")
    ap.add_argument("--batches", type=int, default=12, help="timed micro-batches per side")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()

    import polars as pl
    import torch

    from model.config import IGNORE_INDEX
    from model.loading import load_causal_lm
    from model.logprobs import prefix_shared_logprobs, response_logprobs, token_logprobs
    from model.losses import sft_loss
    from tasks.train.encoding import pad_id_of
    from warehouse import Warehouse

    torch.set_num_threads(1)
    wh = Warehouse(args.home)
    if not (wh.exists("judge_data") and wh.exists("models")):
        raise SystemExit(f"{args.home}: no judge_data or models table; run the pipeline first (make run)")
    data = wh.read("judge_data")
    judge = wh.read("models").filter(pl.col("stage") == "judge")
    if judge.height == 0 or data.height == 0:
        raise SystemExit(f"{args.home}: no judge stage model or judge_data; run the pipeline first")
    model, tokenizer = load_causal_lm(judge["path"][-1])
    model.train()
    pad = pad_id_of(tokenizer)
    batches = sft_micro_batches(data, tokenizer, args.micro, args.batches, args.max_tokens)

    def step(batch, shared: bool) -> tuple[float, int]:
        inputs = (model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        t0 = time.perf_counter()
        out = response_logprobs(*inputs, pad_id=pad, prefix_shared=shared)   # the stage's call
        loss = sft_loss(out.logp, batch["labels"][:, 1:] != IGNORE_INDEX, "token") + out.aux
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, out.tokens_saved

    with torch.no_grad():
        b = batches[0]
        inputs = (model, b["input_ids"], b["attention_mask"], b["labels"])
        mask = b["labels"][:, 1:] != IGNORE_INDEX
        diff = (prefix_shared_logprobs(*inputs, pad_id=pad).logp - token_logprobs(*inputs)[0])[mask].abs().max()
    print(f"judge model {judge['path'][-1]}\n{len(batches)} micro-batches of {args.micro} judge_data rows; "
          f"max |dlogp| shared vs re-encoded {float(diff):.2e}")
    step(batches[0], True)
    step(batches[0], False)
    saved_total = 0

    def timed(batch, shared: bool) -> float:
        nonlocal saved_total
        seconds, saved = step(batch, shared)
        saved_total += saved
        return seconds

    times = alternating_tokens_per_second(batches, timed)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    shared_tps, plain_tps = statistics.median(times[True]), statistics.median(times[False])
    print(f"re-encoding {plain_tps:,.0f} tokens/s, prefix-shared {shared_tps:,.0f} tokens/s "
          f"(forward+backward, median of {len(times[True])}); forwarded {1 - saved_total / tokens:.0%} of "
          f"{tokens:,} tokens\nspeed-up {shared_tps / plain_tps:.2f}x")


if __name__ == "__main__":
    main()
