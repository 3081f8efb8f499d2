"""What a model sees: one rendering of a prompt per model, used by every stage.

A prompt reaches a model as one user turn holding the prompt and its domain's instruction
(the answer format that domain's verifier reads), through the tokenizer's chat template
(ChatML when it has none), with the assistant turn opened. SFT, DPO and RL encode it, and
difficulty, evaluate, the references' candidates and calibration sample from it, so the pass
rates difficulty records and the scores evaluate reports are measured on the prompts training
saw.

One answer format per domain:
- math: the final answer in ``\\boxed{}`` (read by ``tasks.verify.math``);
- code: the whole function in one fenced ```python block (read by ``tasks.verify.code``);
- logic: ``<answer>`` tags, which a synthetic task's prompt already asks for in its own words;
- open prompts (general, instruction) and the judge's: the whole response, no instruction added.
"""
from __future__ import annotations

from collections.abc import Callable

DOMAIN_INSTRUCTIONS: dict[str, str] = {
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "code": "Complete the Python function above. Give the whole function in one ```python code block.",
}


# a logic prompt that states no format of its own (an ingested puzzle, not a synthetic task)
LOGIC_INSTRUCTION = "Think it through, then give only your final answer inside <answer></answer> tags."


def prompt_content(prompt: str, domain: str | None) -> str:
    """The user turn's text: the prompt, then its domain's instruction (none for open and judge
    prompts, whose answer is the whole response, nor for a logic prompt stating its own format)."""
    instruction = DOMAIN_INSTRUCTIONS.get(domain or "", "")
    if domain == "logic" and "<answer>" not in prompt:
        instruction = LOGIC_INSTRUCTION
    return f"{prompt}\n\n{instruction}" if instruction else prompt


def render_prompt(format_chat: Callable[[list[dict[str, str]]], str], prompt: str, domain: str | None) -> str:
    """The rendered prompt: ``format_chat`` is a backend's ``format_chat`` or ``tokenizer_chat(tokenizer)``."""
    return format_chat([{"role": "user", "content": prompt_content(prompt, domain)}])


def render_chatml(messages: list[dict[str, str]]) -> str:
    """ChatML rendering, used for tokenizers that ship no chat template of their own."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def render_with_tokenizer(tokenizer, messages: list[dict[str, str]]) -> str:
    """The tokenizer's own chat template when it has one, ChatML otherwise."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_chatml(messages)


def tokenizer_chat(tokenizer) -> Callable[[list[dict[str, str]]], str]:
    """A ``format_chat`` for a bare tokenizer (the training stages have no backend)."""
    return lambda messages: render_with_tokenizer(tokenizer, messages)
