"""A scripted rollout backend for tests: a test fake of a ``RolloutBackend`` (no model can judge or
answer in a unit test), replying to each prompt by a rule and recording every prompt it was given."""
from __future__ import annotations

from collections.abc import Callable

from tasks.rollout.base import Completion


class ScriptedBackend:
    """``reply(prompt)`` is each of the ``params.n`` completions of a prompt (with ``tokens`` token
    ids, for code that reads lengths); the chat template is the last message's content."""

    name = "scripted"

    def __init__(self, reply: Callable[[str], str], model_name: str = "scripted", tokens: int = 0):
        self.reply, self.model_name, self.tokens = reply, model_name, tokens
        self.prompts: list[str] = []

    def format_chat(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, params):
        self.prompts += prompts
        return [[Completion(self.reply(p), token_ids=list(range(self.tokens))) for _ in range(params.n)]
                for p in prompts]
