"""Held-out environment episodes scored as success rate in the evaluate ladder.

Each configured environment plays ``seeds`` episodes whose seeds start at
``data_specs.agents.HELDOUT_SEED_BASE`` (the agent stage trains on seeds below it), ``n`` samples
each, with the model evaluated as the policy: a local model samples token-exact; any other backend
(an OpenAI-compatible server, vLLM) plays through its text. An episode's success is the
environment's verdict; an item's pass@k counts its successful samples, so the ladder's
``agent/<environment>`` rows read like every other benchmark's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from data_specs.agents import HELDOUT_SEED_BASE
from tasks.agents.rollout import EpisodeRunner, EpisodeSpec, LocalPolicy, TextPolicy, run_episodes
from tasks.rollout.base import SamplingParams

AGENT_BENCHMARK = "agent"


class HeldoutEnvironment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    settings: dict = Field(default_factory=dict)


class AgentHeldout(BaseModel):
    """The ``evaluate.agent`` block: which environments, how many held-out seeds and samples."""
    model_config = ConfigDict(extra="forbid")
    environments: list[HeldoutEnvironment] = Field(default_factory=list)
    seeds: int = Field(32, ge=1)
    n: int = Field(1, ge=1, description="samples per episode")
    max_turn_tokens: int = Field(256, ge=1)
    max_tokens: int = Field(2048, ge=8)
    keep_thinking: bool = True
    window: int = Field(64, ge=1, description="episodes sampled together")
    stages: list[str] | None = Field(
        None, description="the ladder stages whose models play the held-out episodes (None: every stage; a "
                          "model named by hand always plays). Each stage's episodes cost minutes on a CPU; "
                          "[rl, agent] measures what the agent stage adds")

    def plays_at(self, stage: str | None) -> bool:
        return self.stages is None or stage is None or stage in self.stages


@dataclass(frozen=True)
class EpisodeScore:
    """One held-out episode's samples: how many succeeded (the evaluate stage's item result)."""
    benchmark: str
    item_id: str
    row: dict
    n: int
    successes: int
    mean_tokens: float
    errors: int
    first_error: str | None


def agent_benchmark(env: str) -> str:
    return f"{AGENT_BENCHMARK}/{env}"


def heldout_specs(cfg: AgentHeldout) -> dict[str, list[EpisodeSpec]]:
    out = {}
    for env in cfg.environments:
        settings = json.dumps(env.settings, sort_keys=True)
        out[env.name] = [EpisodeSpec(env.name, dict(env.settings), HELDOUT_SEED_BASE + i,
                                     f"{env.name}:{settings}:heldout{i}") for i in range(cfg.seeds)]
    return out


def policy_for(backend):
    """The evaluated backend as a policy: token-exact for the local sampler, through text otherwise."""
    if hasattr(backend, "generate_ids"):
        return LocalPolicy(backend), backend.tokenizer
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"agent evaluation through the {backend.name!r} backend needs a local tokenizer (its chat "
                         "template renders the episodes): set rollout.openai.tokenizer")
    return TextPolicy(backend, tokenizer), tokenizer


def evaluate_agent(backend, cfg: AgentHeldout, temperature: float, top_p: float, seed: int) -> list[EpisodeScore]:
    """One ``EpisodeScore`` per held-out episode (benchmark ``agent/<environment>``)."""
    policy, tokenizer = policy_for(backend)
    runner = EpisodeRunner(tokenizer, keep_thinking=cfg.keep_thinking, max_tokens=cfg.max_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    out = []
    for env, specs in heldout_specs(cfg).items():
        played = run_episodes(runner, policy, specs, cfg.n, params, cfg.max_turn_tokens, cfg.window,
                              prefix=f"eval:{env}")
        by_task: dict[str, list] = {}
        for t in played:
            by_task.setdefault(t.spec.task_id, []).append(t)
        for spec in specs:
            ts = by_task.get(spec.task_id, [])
            faults = [t for t in ts if t.ended == "tool_error"]
            out.append(EpisodeScore(agent_benchmark(env), f"{env}/{spec.seed}", {"environment": env, "seed": spec.seed},
                                    len(ts), sum(t.success for t in ts),
                                    sum(len(t.transcript.ids) - t.transcript.prompt_length for t in ts) / max(1, len(ts)),
                                    len(faults), faults[0].record[-1]["content"] if faults else None))
    return out
