"""The one rollout interface every backend implements (local, vllm, openai).

Prompts go in as plain strings (already chat-formatted by the caller, or raw text for
base models); each prompt gets ``n`` completions back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int = 0
    # M1 repetition early truncation: stop once this many consecutive tokens each had
    # probability above ``repetition_prob``; None disables it.
    repetition_window: int | None = None
    repetition_prob: float = 0.99
    logprobs: bool = True
    # One random stream per sequence, seeded by (seed, the prompt's ids, the sample's index):
    # a sequence's tokens then do not depend on what else shares its batch (batch size, chunking,
    # other rows stopping early), and two models sampled on the same prompt draw the same
    # uniforms (common random numbers, as a paired comparison of stages wants). False: one
    # stream for the whole call (what training rollouts have always drawn).
    seed_per_sequence: bool = False


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    # log-probability of each sampled token under the sampling distribution, when the
    # backend reports it; None otherwise. A token whose log-prob the backend left out (an
    # OpenAI-compatible server's ``null``) is None in the list: unknown, never probability 1.
    logprobs: list[float | None] | None = None
    # "stop" (EOS or stop string), "length" (max_tokens), "repetition" (early truncation)
    finish_reason: str = "stop"
    # the version of the weights that sampled it, when the backend reports one (a trainer-fed
    # ``serve-model`` engine: the optimizer steps behind those weights); in a partial rollout,
    # the version of its first token
    policy_version: int | None = None
    # a partial rollout (its generation went on across a weight update): the version that sampled
    # its tokens from ``version_boundary`` on; None when one version sampled every token
    policy_version_last: int | None = None
    version_boundary: int | None = None

    @property
    def last_version(self) -> int | None:
        """The version of the weights that sampled the last token."""
        return self.policy_version if self.version_boundary is None else self.policy_version_last

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "repetition"

    def logprob_summary(self) -> tuple[float | None, float | None]:
        """(sum, mean) of the sampled tokens' log-probs; (None, None) when the backend reported
        none or left any token's out (a partial sum would pass for a likelier sample)."""
        lp = self.logprobs
        if not lp or any(x is None for x in lp):
            return None, None
        total = float(sum(lp))
        return total, total / len(lp)


@runtime_checkable
class RolloutBackend(Protocol):
    name: str

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """Return, for each prompt, ``params.n`` completions."""
        ...

    def format_chat(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages with the model's chat template, ready for ``generate``."""
        ...
