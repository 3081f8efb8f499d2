"""Direct preference optimization stage (short or long), sigmoid loss.

Reference log-probs come from the stage's initial model; they are computed once, before
the first step, and stored beside the checkpoints (``reference_logps.json``), so a
resumed stage and every rank use the very same numbers.
"""
from __future__ import annotations

import json

import torch

from model.config import IGNORE_INDEX
from model.logprobs import response_logprobs
from model.losses import dpo_loss, sequence_logprob
from tasks.train import checkpoint
from tasks.train.encoding import batch_indices, encode_example, pad_batch, pad_id_of
from tasks.train.engine import backward_and_step, current_lr
from tasks.train.harness import StageHarness, ids_digest


def _sequence_logps(model, encoded: list[tuple[list[int], int]], pad: int, max_tokens: int,
                    prefix_shared: bool) -> torch.Tensor:
    """Summed response log-probs; with ``prefix_shared`` a pair's chosen and rejected rows, in
    one batch, encode their prompt once."""
    batch = pad_batch([e[0] for e in encoded], [e[1] for e in encoded], pad, max_tokens)
    inputs = (model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    logp = response_logprobs(*inputs, pad_id=pad, prefix_shared=prefix_shared).logp
    return sequence_logprob(logp, batch["labels"][:, 1:] != IGNORE_INDEX)


@torch.no_grad()
def reference_logps(h: StageHarness, model, pair_ids, chosen, rejected, pad: int) -> dict[str, list[float]]:
    """pair_id -> [log pi_ref(chosen), log pi_ref(rejected)], computed once and stored."""
    path = h.path / "reference_logps.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if set(stored) >= set(pair_ids):
            return stored
    was_training = model.training
    model.eval()
    out: dict[str, list[float]] = {}
    size = h.cfg.engine.micro_batch_size
    for start in range(0, len(pair_ids), size):
        sl = slice(start, start + size)
        if h.stage_cfg.prefix_shared:   # a pair in one batch: its prompt is encoded once
            both = _sequence_logps(model, chosen[sl] + rejected[sl], pad, h.stage_cfg.max_tokens, True)
            c, r = both[: len(chosen[sl])], both[len(chosen[sl]):]
        else:
            c = _sequence_logps(model, chosen[sl], pad, h.stage_cfg.max_tokens, False)
            r = _sequence_logps(model, rejected[sl], pad, h.stage_cfg.max_tokens, False)
        for pid, vc, vr in zip(pair_ids[sl], c.tolist(), r.tolist()):
            out[pid] = [vc, vr]
    model.train(was_training)
    if h.is_rank0:
        checkpoint.write_atomic(path, json.dumps(out))
    return out


def train_dpo(h: StageHarness) -> dict:
    model, tokenizer = h.load_policy()
    data = h.read_data()
    pair_ids = data["pair_id"].to_list()
    chosen = [encode_example(tokenizer, p, c, d) for p, c, d in zip(data["prompt"], data["chosen"], data["domain"])]
    rejected = [encode_example(tokenizer, p, r, d) for p, r, d in zip(data["prompt"], data["rejected"], data["domain"])]
    pad = pad_id_of(tokenizer)
    if h.partitioned:   # ZeRO-3: the reference is scored through the engine, one module gathered at a time
        engine = h.create_engine(model)
        reference = reference_logps(h, engine.module, pair_ids, chosen, rejected, pad)
    else:               # whole: scored before the engine exists (in FP32 where the engine casts to bf16)
        reference = reference_logps(h, model, pair_ids, chosen, rejected, pad)
        engine = h.create_engine(model)
    cfg = h.stage_cfg
    start, _ = h.resume(engine)
    loss_value = None
    for step in range(start, cfg.steps):
        indices = batch_indices(step, len(pair_ids), h.global_batch(), h.cfg.seed)
        losses, stats_sum, norm = [], {}, None
        micro_batches = h.rank_micro_batches(indices)
        for micro in micro_batches:
            both = _sequence_logps(engine.module, [chosen[i] for i in micro] + [rejected[i] for i in micro],
                                   pad, cfg.max_tokens, cfg.prefix_shared)
            policy_c, policy_r = both[: len(micro)], both[len(micro):]
            ref = torch.tensor([reference[pair_ids[i]] for i in micro])
            loss, stats = dpo_loss(policy_c, policy_r, ref[:, 0], ref[:, 1], cfg.beta)
            step_norm = backward_and_step(engine, loss)
            norm = step_norm if step_norm is not None else norm
            losses.append(loss.item())
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v / len(micro_batches)
        loss_value = sum(losses) / len(losses)
        h.record(step, {"loss": loss_value, "grad_norm": norm or 0.0, "lr": current_lr(engine), **stats_sum},
                 batch_digest=ids_digest([pair_ids[i] for i in indices]))
        h.maybe_checkpoint(engine, step)
    return h.finish(engine, tokenizer, {"final_loss": loss_value, "pairs": len(pair_ids)},
                    curves=("loss", "reward_margin", "reward_accuracy"))
