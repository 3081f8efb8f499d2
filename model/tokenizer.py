"""Byte-level BPE tokenizer trained in-house, saved as a Hugging Face tokenizer with a chat template.

Role markers and bos/eos/pad are special tokens (dropped by ``skip_special_tokens``); the
reasoning tags ``<think>`` ``</think>`` ``<answer>`` ``</answer>`` are single tokens that stay
in decoded text, because verifiers parse them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
REASONING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)

# Each turn: role marker, newline, content, eos. Assistant turns end with eos, so generation
# stops there; add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('chat role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts``, save it to ``out_dir`` and return the HF tokenizer."""
    min_vocab = 256 + len(SPECIAL_TOKENS) + len(REASONING_TAGS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet plus specials ({min_vocab})")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(REASONING_TAGS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator((t for t in texts if t), trainer=trainer)
    bpe.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in REASONING_TAGS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return tokenizer
