"""Supervised fine-tuning stage (short or long): masked next-token NLL on the response, plus the
prompt's, weighted, when the stage sets a prompt loss."""
from __future__ import annotations

import torch

from model.config import IGNORE_INDEX
from model.logprobs import response_logprobs
from model.losses import sft_loss
from tasks.train.encoding import batch_indices, encode_example, pad_batch, pad_id_of
from tasks.train.engine import backward_and_step, current_lr
from tasks.train.harness import StageHarness, ids_digest


def train_sft(h: StageHarness) -> dict:
    model, tokenizer = h.load_policy()
    data = h.read_data()
    example_ids = data["example_id"].to_list()
    encoded = [encode_example(tokenizer, p, r, d) for p, r, d in zip(data["prompt"], data["response"], data["domain"])]
    pad = pad_id_of(tokenizer)
    cfg = h.stage_cfg
    engine = h.create_engine(model)
    start, _ = h.resume(engine)
    loss_value = None
    for step in range(start, cfg.steps):
        indices = batch_indices(step, len(encoded), h.global_batch(), h.cfg.seed)
        micro_losses, response_losses, tokens, saved, norm = [], [], 0, 0, None
        for micro in h.rank_micro_batches(indices):
            prompt_lengths = [encoded[i][1] for i in micro]
            batch = pad_batch([encoded[i][0] for i in micro], prompt_lengths, pad, cfg.max_tokens)
            labels, mask = batch["labels"], batch["labels"][:, 1:] != IGNORE_INDEX
            if cfg.prompt_loss_weight > 0:   # the prompt's tokens are scored too
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
            # shared e.g. by judge examples: the same grading instructions open every prompt
            out = response_logprobs(engine.module, batch["input_ids"], batch["attention_mask"], labels, pad_id=pad,
                                    prefix_shared=cfg.prefix_shared, prompt_lengths=torch.tensor(prompt_lengths))
            saved += out.tokens_saved
            loss = sft_loss(out.logp, mask, cfg.normalization) + out.aux
            if cfg.prompt_loss_weight > 0:
                response_losses.append(loss.item())
                loss = loss + cfg.prompt_loss_weight * sft_loss(out.logp, out.scored & ~mask, cfg.normalization)
            step_norm = backward_and_step(engine, loss)
            norm = step_norm if step_norm is not None else norm
            micro_losses.append(loss.item())
            tokens += int(mask.sum())
        loss_value = sum(micro_losses) / len(micro_losses)
        metrics = {"loss": loss_value, "grad_norm": norm or 0.0, "lr": current_lr(engine), "tokens": tokens,
                   "prefix_shared_tokens_saved": saved}
        if response_losses:   # the response's own loss, comparable with a run without a prompt loss
            metrics["response_loss"] = sum(response_losses) / len(response_losses)
        h.record(step, metrics,
                 batch_digest=ids_digest([example_ids[i] for i in indices]))
        h.maybe_checkpoint(engine, step)
    return h.finish(engine, tokenizer, {"final_loss": loss_value, "examples": len(encoded)})
