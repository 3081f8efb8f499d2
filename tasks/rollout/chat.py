"""Rendering chat messages into a prompt string."""
from __future__ import annotations


def render_chatml(messages: list[dict[str, str]]) -> str:
    """ChatML rendering, used for tokenizers that ship no chat template of their own."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def render_with_tokenizer(tokenizer, messages: list[dict[str, str]]) -> str:
    """The tokenizer's own chat template when it has one, ChatML otherwise."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_chatml(messages)
