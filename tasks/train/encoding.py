"""What a training rank needs to turn rows into token batches: the prompt as the model sees it,
its token ids, prompt + response examples, right-padded batches with masked labels, the seeded
order of each optimizer step's examples, and the length-range stage of an example.

Imports no warehouse: the SFT, DPO and RL stages use it on the ranks, and the table builders
(``tasks.train.data``) use it to measure and assign examples.
"""
from __future__ import annotations

import random

import torch

from model.config import IGNORE_INDEX
from tasks.rollout.chat import render_prompt, tokenizer_chat


def prompt_text(tokenizer, prompt: str, domain: str | None) -> str:
    """The prompt as the model sees it in every stage (``tasks.rollout.chat.render_prompt``):
    one user turn with the domain's answer instruction, the assistant turn opened."""
    return render_prompt(tokenizer_chat(tokenizer), prompt, domain)


def encode_prompt(tokenizer, prompt: str, domain: str | None) -> list[int]:
    """Token ids of the rendered prompt, encoded as the local sampler encodes it."""
    text = prompt_text(tokenizer, prompt, domain)
    bos = tokenizer.bos_token
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def encode_example(tokenizer, prompt: str, response: str, domain: str | None) -> tuple[list[int], int]:
    """(token ids of prompt + response + EOS, number of prompt tokens).

    Prompt and response are encoded apart so the boundary between them is exact.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, domain)
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response_ids = response_ids + [tokenizer.eos_token_id]
    return list(prompt_ids) + list(response_ids), len(prompt_ids)


def pad_batch(sequences: list[list[int]], prompt_lengths: list[int], pad_id: int,
              max_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and labels with prompt and padding set to IGNORE_INDEX."""
    if max_tokens is not None:
        sequences = [s[:max_tokens] for s in sequences]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, (seq, n_prompt) in enumerate(zip(sequences, prompt_lengths)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, n_prompt: len(seq)] = torch.tensor(seq[n_prompt:], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pad_id_of(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def batch_indices(step: int, num_examples: int, batch_size: int, seed: int) -> list[int]:
    """The examples of optimizer step ``step`` (0-based): a seeded permutation per epoch.

    A pure function of (step, seed), so a resumed stage sees exactly the data order the
    killed one would have seen.
    """
    if num_examples == 0:
        raise ValueError("the stage has no examples")
    out: list[int] = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, num_examples)
        order = list(range(num_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        take = min(batch_size - len(out), num_examples - offset)
        out.extend(order[offset: offset + take])
        position += take
    return out


def stage_of_length(num_tokens: int, ranges: dict[str, tuple[int, int]]) -> str | None:
    for stage, (low, high) in ranges.items():
        if low <= num_tokens <= high:
            return stage
    return None
