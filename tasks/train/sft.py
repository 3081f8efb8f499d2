"""Supervised fine-tuning stage (short or long): masked next-token NLL on the response."""
from __future__ import annotations

from model.losses import IGNORE_INDEX, response_logprobs, sft_loss
from tasks.train.data import batch_indices, encode_example, pad_batch, pad_id_of
from tasks.train.engine import backward_and_step, current_lr
from tasks.train.harness import StageHarness, ids_digest


def train_sft(h: StageHarness) -> dict:
    model, tokenizer = h.load_policy()
    data = h.read_data()
    example_ids = data["example_id"].to_list()
    encoded = [encode_example(tokenizer, p, r) for p, r in zip(data["prompt"], data["response"])]
    pad = pad_id_of(tokenizer)
    cfg = h.stage_cfg
    engine = h.create_engine(model)
    start, _ = h.resume(engine)
    loss_value = None
    for step in range(start, cfg.steps):
        indices = batch_indices(step, len(encoded), h.global_batch(), h.cfg.seed)
        micro_losses, tokens, saved, norm = [], 0, 0, None
        for micro in h.rank_micro_batches(indices):
            batch = pad_batch([encoded[i][0] for i in micro], [encoded[i][1] for i in micro], pad,
                              cfg.max_tokens)
            inputs = (engine.module, batch["input_ids"], batch["attention_mask"], batch["labels"])
            # shared e.g. by judge examples: the same grading instructions open every prompt
            logp, _, aux, tokens_saved = response_logprobs(*inputs, pad_id=pad, prefix_shared=cfg.prefix_shared)
            saved += tokens_saved
            mask = batch["labels"][:, 1:] != IGNORE_INDEX
            loss = sft_loss(logp, mask, cfg.normalization) + aux
            step_norm = backward_and_step(engine, loss)
            norm = step_norm if step_norm is not None else norm
            micro_losses.append(loss.item())
            tokens += int(mask.sum())
        loss_value = sum(micro_losses) / len(micro_losses)
        h.record(step, {"loss": loss_value, "grad_norm": norm or 0.0, "lr": current_lr(engine), "tokens": tokens,
                        "prefix_shared_tokens_saved": saved},
                 batch_digest=ids_digest([example_ids[i] for i in indices]))
        h.maybe_checkpoint(engine, step)
    return h.finish(engine, tokenizer, {"final_loss": loss_value, "examples": len(encoded)})
