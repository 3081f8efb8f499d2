"""Memory of loading a policy for a ZeRO-3 engine on 2 CPU ranks: partitioned (``load_causal_lm``
with ``zero3_config``: built under ``deepspeed.zero.Init``, the checkpoint filled in one module
at a time) vs whole (every rank loads all of it in FP32, then DeepSpeed partitions it).

Each mode runs in its own ``torchrun`` launch (fresh ranks), SmolLM2-135M-Instruct by default
(the ``smol`` model, about 540 MB in FP32). Per rank it records the peak RSS growth while
loading (``VmHWM`` reset right before the load, so import-time peaks do not count; and the
peak of its anonymous memory, without checkpoint pages mapped from the file), the
parameter bytes the rank holds after loading (its partitions when partitioned) and after
``create_engine``, and the log-probs of a fixed batch scored through the ZeRO-3 engine. Prints a
table and the ratio of each rank's loading peak, partitioned / whole, against the model's size.

    python bench/zero3_memory.py [--model smol|PATH] [--ranks 2] [--malloc-mmap-threshold 1048576]

The same script is each rank's body (``--worker``); tests/test_zero3_loading.py runs it on a
smaller model. Linux only (``/proc/self/clear_refs`` resets the peak).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("sharded", "whole")
MIB = 2**20


# -- one rank -------------------------------------------------------------------------------
def _reset_peak_rss() -> int:
    """Make the kernel's peak RSS (VmHWM) the current RSS; that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class AnonymousPeak:
    """Peak anonymous RSS (``RssAnon``, sampled every 2 ms in a thread) since ``reset``: the
    memory a rank really takes, without checkpoint pages mapped from the file (page cache,
    which the peak RSS counts on the rank that reads the checkpoint)."""

    def __init__(self):
        import threading

        self.peak = 0
        threading.Thread(target=self._sample, daemon=True).start()

    def reset(self) -> int:
        self.peak = current = _status_kib("RssAnon") * 1024
        return current

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, _status_kib("RssAnon") * 1024)
            time.sleep(0.002)


def param_bytes(model) -> tuple[int, int]:
    """(bytes of parameter storage this rank holds, bytes of the whole model's parameters):
    under ZeRO-3 a parameter's storage is its partition (``ds_tensor``), its size ``ds_numel``."""
    held = full = 0
    for p in {id(p): p for p in model.parameters()}.values():
        size = p.element_size()
        if hasattr(p, "ds_tensor"):
            held += p.ds_tensor.numel() * size
            full += p.ds_numel * size
        else:
            held += p.numel() * size
            full += p.numel() * size
    return held, full


def probe_batch(vocab_size: int, seed: int = 0, length: int = 24):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (2, length), generator=gen)
    return ids, torch.ones_like(ids)


def train_steps(engine, steps: int, tokens: int, anonymous: AnonymousPeak) -> dict:
    """``steps`` optimizer steps of the ZeRO-3 engine on one fixed batch of 2 x ``tokens``
    (the first a warm-up, not timed): seconds per step, and the peak anonymous memory above the
    rank's memory before the first step."""
    import torch

    from tasks.train.engine import backward_and_step

    ids, mask = probe_batch(engine.module.config.vocab_size, seed=1, length=tokens)
    engine.module.train()
    base = anonymous.reset()
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        loss = engine.module(input_ids=ids, attention_mask=mask, labels=ids).loss
        backward_and_step(engine, loss)
        times.append(time.perf_counter() - started)
    torch.distributed.barrier()
    return {"step_seconds": round(sum(times[1:]) / steps, 3), "train_anon_peak_bytes": anonymous.peak - base}


def rank_worker(model_path: str, modes: list[str], out_dir: Path, steps: int = 0, tokens: int = 256) -> None:
    import torch

    from model.logprobs import token_logprobs
    from tasks.train import proc
    from tasks.train.config import EngineConfig, OptimizerConfig
    from tasks.train.ds_config import deepspeed_config
    from tasks.train.engine import create_engine, prepare_environment, rank, world_size

    engine_cfg = EngineConfig(zero_stage=3, precision="fp32", micro_batch_size=1, num_ranks=world_size(),
                              launcher="torchrun")
    prepare_environment(engine_cfg)
    proc.ensure_comm_op()
    import deepspeed

    from model.loading import load_causal_lm

    deepspeed.init_distributed()
    from transformers import AutoConfig, AutoModelForCausalLM

    # the model's modeling module imported now, not inside the first measured load
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_path))]
    # what create_engine builds (the stage harness hands the same to load_causal_lm)
    ds_config = deepspeed_config(engine_cfg)
    ds_config["train_batch_size"] = engine_cfg.micro_batch_size * world_size()
    anonymous = AnonymousPeak()
    results = {}
    for mode in modes:
        gc.collect()
        torch.distributed.barrier()
        rss_before, anon_before = _reset_peak_rss(), anonymous.reset()
        started = time.perf_counter()
        model, _ = load_causal_lm(model_path, dtype="float32",
                                  zero3_config=ds_config if mode == "sharded" else None)
        seconds = time.perf_counter() - started
        peak = _status_kib("VmHWM") * 1024 - rss_before
        anon_peak = anonymous.peak - anon_before
        held, full = param_bytes(model)
        head = type(model.get_output_embeddings()).__name__
        engine, _ = create_engine(model.train(), engine_cfg, OptimizerConfig(), 1e-5, 1)
        held_in_engine, _ = param_bytes(engine.module)
        engine.module.eval()
        ids, mask = probe_batch(engine.module.config.vocab_size)
        with torch.no_grad():
            logp = token_logprobs(engine.module, ids, mask)[0]
        results[mode] = {"load_peak_bytes": peak, "load_anon_peak_bytes": anon_peak, "load_seconds": round(seconds, 2), "held_param_bytes": held,
                         "held_param_bytes_in_engine": held_in_engine, "model_param_bytes": full,
                         "head": head, "logp": logp.tolist()}
        if steps:
            results[mode].update(train_steps(engine, steps, tokens, anonymous))
        engine.destroy()
        del engine, model
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank()}.json").write_text(json.dumps(results))


# -- the driver -------------------------------------------------------------------------------
def launch(model_path: Path, modes: list[str], out_dir: Path, ranks: int = 2, timeout_s: float = 600,
           mmap_threshold: int | None = None, steps: int = 0, tokens: int = 256) -> list[dict]:
    """Run ``rank_worker`` on ``ranks`` torchrun ranks; each rank's results, by rank.

    ``mmap_threshold`` (bytes) fixes glibc's mmap threshold in the ranks
    (``MALLOC_MMAP_THRESHOLD_``): ``zero.Init`` creates each module's parameters whole, keeps a
    partition and frees the rest, and glibc's dynamic threshold then serves later blocks from
    the heap, where the smaller partitions fill the freed holes only in part."""
    from tasks.train.engine import subprocess_env, torchrun_command

    cmd = torchrun_command(ranks, str(Path(__file__).resolve()), "--worker", "--model", str(model_path),
                           "--out", str(out_dir), "--modes", *modes, "--train-steps", str(steps),
                           "--train-tokens", str(tokens))
    env = subprocess_env({"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ranks failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)]


def _resolve(model: str) -> Path:
    if model == "smol":
        from tasks.rollout.smol import smollm2_path
        return smollm2_path()
    return Path(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smol", help="'smol' or a Hugging Face model directory")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help="run as one rank (started by torchrun)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="fix glibc's mmap threshold in the ranks (e.g. 1048576); default: glibc's dynamic one")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="after loading, time this many ZeRO-3 optimizer steps (plus one warm-up) per mode")
    parser.add_argument("--train-tokens", type=int, default=256, help="tokens per row of the 2-row training batch")
    args = parser.parse_args()
    if args.worker:
        rank_worker(args.model, args.modes, args.out, args.train_steps, args.train_tokens)
        return

    import tempfile

    import torch

    model_path = _resolve(args.model)
    per_mode = {}
    with tempfile.TemporaryDirectory(prefix="zero3-memory-") as tmp:
        for mode in args.modes:   # a fresh launch per mode: nothing left over from the other
            started = time.perf_counter()
            ranks = launch(model_path, [mode], Path(tmp) / mode, args.ranks,
                           mmap_threshold=args.malloc_mmap_threshold, steps=args.train_steps,
                           tokens=args.train_tokens)
            per_mode[mode] = [r[mode] for r in ranks]
            print(f"{mode}: launch done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    full = per_mode[args.modes[0]][0]["model_param_bytes"]
    threshold = args.malloc_mmap_threshold
    print(f"model: {model_path.name}, {full / MIB:.1f} MiB of FP32 parameters; {args.ranks} ranks, ZeRO-3, CPU; "
          f"glibc mmap threshold: {f'{threshold} bytes' if threshold else 'dynamic (default)'}")
    print(f"{'mode':8} {'rank':>4} {'peak RSS MiB':>13} {'/ model':>8} {'peak anon MiB':>14} {'/ model':>8} "
          f"{'params held MiB':>16} {'in engine MiB':>14} {'load s':>7}")
    for mode, ranks in per_mode.items():
        for r, res in enumerate(ranks):
            print(f"{mode:8} {r:>4} {res['load_peak_bytes'] / MIB:>13.1f} {res['load_peak_bytes'] / full:>8.2f} "
                  f"{res['load_anon_peak_bytes'] / MIB:>14.1f} {res['load_anon_peak_bytes'] / full:>8.2f} "
                  f"{res['held_param_bytes'] / MIB:>16.1f} {res['held_param_bytes_in_engine'] / MIB:>14.1f} "
                  f"{res['load_seconds']:>7.2f}")
    if set(MODES) <= set(per_mode):
        for r in range(args.ranks):
            sharded, whole = per_mode["sharded"][r], per_mode["whole"][r]
            print(f"rank {r}: loading peak sharded / whole: RSS "
                  f"{sharded['load_peak_bytes'] / whole['load_peak_bytes']:.2f}, anonymous "
                  f"{sharded['load_anon_peak_bytes'] / whole['load_anon_peak_bytes']:.2f}; "
                  f"params held {sharded['held_param_bytes'] / full:.2f} of the model")
    if args.train_steps:
        for mode, ranks in per_mode.items():
            for r, res in enumerate(ranks):
                print(f"train {mode:8} rank {r}: {res['step_seconds']:.3f} s/step over {args.train_steps} steps of "
                      f"2 x {args.train_tokens} tokens, peak anon above the loaded engine "
                      f"{res['train_anon_peak_bytes'] / MIB:.1f} MiB")
    if set(MODES) <= set(per_mode):
        gap = (torch.tensor(per_mode["sharded"][0]["logp"]) - torch.tensor(per_mode["whole"][0]["logp"])).abs().max()
        print(f"heads: sharded {per_mode['sharded'][0]['head']}, whole {per_mode['whole'][0]['head']}; "
              f"max |Δ log-prob| through the ZeRO-3 engine, sharded vs whole load: {float(gap):.2e}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
