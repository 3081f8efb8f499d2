"""Multi-turn rollouts: episodes driven turn by turn, token-exact, under a windowed FIFO.

A ``Trajectory`` is one episode: its environment (live), its ``Transcript`` (ids as sampled, the
loss mask, the sampler's log-probs, each turn's policy version) and its text record. The
``EpisodeRunner`` opens one (``reset``, the prompt rendered once), applies a sampled turn (parsed
into an ``Action``, stepped in the environment, the observation's bridge tokens appended), and
restores one from its state by replaying its actions (environments are deterministic given seed
and actions), so a paused trajectory survives a checkpoint and a kill.

The ``WindowedFIFO`` (MiniMax-M2.5's scheduler) keeps at most ``window`` trajectories live; each
round samples one turn of every live trajectory in one batch. Groups enter in order; a trajectory
that has held its slot for ``max_live_rounds`` rounds while others wait is paused (kept, state and
all) and goes to the back of the line; a step ends when enough groups are complete, and what is
still live is paused and resumed first at the next step, under newer weights: trajectories are
never thrown away (that starves hard tasks); CISPO's importance weights correct their stale
turns. A trajectory ``max_staleness`` versions behind is never paused again.
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tasks.agents.envs import Action, Environment, make_env
from tasks.agents.render import ToolRenderer, Transcript, encode_text, parse_action, thinking_tokens
from tasks.rollout.base import Completion, SamplingParams


class TokenPolicy(Protocol):
    """What samples a turn: ``params.n`` is 1; one completion per context, token ids and
    log-probs included, and the version of the weights that sampled it."""

    def sample(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    @property
    def version(self) -> int: ...


class LocalPolicy:
    """A ``LocalBackend`` sampling from token ids (the trainer's own module in the agent stage)."""

    def __init__(self, backend, version: Callable[[], int] = lambda: 0):
        self.backend = backend
        self._version = version

    @property
    def version(self) -> int:
        return int(self._version())

    def sample(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        was_training = self.backend.model.training
        groups = self.backend.generate_ids(contexts, params)
        if was_training:
            self.backend.model.train()   # the sampler switched the shared module to eval
        return [g[0] for g in groups]


class TextPolicy:
    """Any ``RolloutBackend`` (an OpenAI-compatible server, vLLM) as the policy, for data and
    evaluation with a strong model: contexts go out as their rendered text and the reply's ids are
    its text encoded (not the server's own ids: fine for scoring, not for training on)."""

    def __init__(self, backend, tokenizer):
        self.backend, self.tokenizer = backend, tokenizer
        self.version = 0

    def sample(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        texts = [self.tokenizer.decode(c, skip_special_tokens=False) for c in contexts]
        out = []
        for group in self.backend.generate(texts, params):
            c = group[0]
            if not c.token_ids:
                c.token_ids = encode_text(self.tokenizer, c.text)
                c.logprobs = None
            out.append(c)
        return out


@dataclass(frozen=True)
class EpisodeSpec:
    """Which episode: an environment with its settings, and a seed."""
    environment: str
    settings: dict
    seed: int
    task_id: str


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    sample_index: int
    spec: EpisodeSpec
    transcript: Transcript = field(default_factory=Transcript)
    messages: list[dict] = field(default_factory=list)     # what the template renders
    record: list[dict] = field(default_factory=list)       # the turns as stored (thinking, calls, results)
    actions: list[str] = field(default_factory=list)       # each turn's decoded text (replayed on restore)
    process_rewards: list[float] = field(default_factory=list)
    outcome: float = 0.0
    success: bool = False
    ended: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    pauses: int = 0
    live_rounds: int = 0
    env: Environment | None = None
    renderer: ToolRenderer | None = None

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def versions(self) -> list[int]:
        return [t.version for t in self.transcript.turns if t.version is not None]

    def state_dict(self) -> dict:
        return {"trajectory_id": self.trajectory_id, "group_id": self.group_id, "sample_index": self.sample_index,
                "spec": self.spec.__dict__, "transcript": self.transcript.state_dict(), "messages": self.messages,
                "record": self.record, "actions": self.actions, "process_rewards": self.process_rewards,
                "outcome": self.outcome, "success": self.success, "ended": self.ended, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "pauses": self.pauses}


class EpisodeRunner:
    """Opens, advances and restores trajectories for one tokenizer and one history setting."""

    def __init__(self, tokenizer, keep_thinking: bool = True, max_tokens: int = 1024):
        self.tokenizer = tokenizer
        self.keep_thinking = keep_thinking
        self.max_tokens = max_tokens           # a trajectory's whole length (prompt included)
        self.eos_text = tokenizer.eos_token

    def open(self, trajectory_id: str, group_id: str, sample_index: int, spec: EpisodeSpec) -> Trajectory:
        t = Trajectory(trajectory_id, group_id, sample_index, spec)
        self._reset(t)
        prompt = t.renderer.render(t.messages, add_generation_prompt=True)
        ids = encode_text(self.tokenizer, prompt)
        t.transcript.extend_env(ids)
        t.transcript.prompt_length = len(ids)
        return t

    def _reset(self, t: Trajectory) -> None:
        t.env = make_env(t.spec.environment, **t.spec.settings)
        reset = t.env.reset(t.spec.seed)
        t.renderer = ToolRenderer(self.tokenizer, reset.tools)
        t.messages = [dict(m) for m in reset.messages]
        t.record = [dict(m) for m in reset.messages]

    def context(self, t: Trajectory) -> list[int]:
        return t.transcript.context(self.keep_thinking)

    def turn_budget(self, t: Trajectory, max_turn_tokens: int) -> int:
        return max(1, min(max_turn_tokens, self.max_tokens - len(t.transcript.ids)))

    def apply(self, t: Trajectory, completion: Completion, version: int | None) -> None:
        """One sampled turn: recorded as sampled, parsed, stepped; the observation appended."""
        ids = list(completion.token_ids)
        t.transcript.extend_policy(ids, completion.logprobs, thinking_tokens(self.tokenizer, ids), version)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.actions.append(text)
        if len(t.transcript.ids) >= self.max_tokens:   # the trajectory's budget is spent: no action to take
            t.record.append({"role": "assistant", "content": text})
            self._end(t, "max_tokens", 0.0, False)
            return
        # a turn cut at the per-turn limit is still the policy's turn: the environment answers what it read
        self._step(t, parse_action(text), text, sampled_eos=ids[-1:] == [self.tokenizer.eos_token_id])

    def _step(self, t: Trajectory, action: Action, text: str, sampled_eos: bool, replay: bool = False) -> None:
        t.messages.append({"role": "assistant", "content": text})
        t.record.append({"role": "assistant", "content": action.text, "thinking": action.thinking,
                         "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in action.tool_calls],
                         **({"parse_error": action.parse_error} if action.parse_error else {})})
        t.tool_calls += len(action.tool_calls)
        try:
            result = t.env.step(action)
        except Exception as e:  # noqa: BLE001 - an environment fault ends the episode, counted, never the run
            t.record.append({"role": "error", "content": f"{type(e).__name__}: {e}"})
            self._end(t, "tool_error", 0.0, False)
            return
        t.process_rewards.append(float(result.reward))
        t.tool_errors += int(result.info.get("tool_error", 0))
        t.record.extend(dict(m) for m in result.observation)
        if result.done:
            self._end(t, result.info.get("ended", "answered"), float(result.info.get("outcome", 0.0)),
                      bool(result.info.get("success", False)))
            return
        bridge = t.renderer.bridge(t.messages, result.observation, self.eos_text if sampled_eos else None)
        t.messages.extend(dict(m) for m in result.observation)
        if not replay:
            t.transcript.extend_env(encode_text(self.tokenizer, bridge))
            if len(t.transcript.ids) >= self.max_tokens:
                self._end(t, "max_tokens", 0.0, False)

    @staticmethod
    def _end(t: Trajectory, reason: str, outcome: float, success: bool) -> None:
        t.ended, t.outcome, t.success = reason, outcome, success
        if t.env is not None:
            t.env.close()
            t.env = None

    def restore(self, state: dict) -> Trajectory:
        """A trajectory from ``state_dict``: its record as stored, its live environment rebuilt by
        replaying its actions (the ids are not re-encoded: they are the stored ones)."""
        t = Trajectory(state["trajectory_id"], state["group_id"], state["sample_index"],
                       EpisodeSpec(**state["spec"]))
        if state["ended"] is None:
            self._reset(t)
            for text in state["actions"]:
                self._step(t, parse_action(text), text, sampled_eos=True, replay=True)
        for key in ("messages", "record", "actions", "process_rewards", "outcome", "success", "ended", "tool_calls",
                    "tool_errors", "pauses"):
            setattr(t, key, state[key])
        t.transcript = Transcript.from_state(state["transcript"])
        return t


@dataclass
class FifoCounters:
    rounds: int = 0
    turns: int = 0
    pauses: int = 0
    resumes: int = 0
    opened: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"fifo_{k}": float(v) for k, v in self.__dict__.items()}


class WindowedFIFO:
    """The scheduler of live trajectories (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, next_group: Callable[[int], list[Trajectory]], window: int,
                 max_live_rounds: int, max_staleness: int, max_turn_tokens: int, group_size: int):
        self.runner = runner
        self.next_group = next_group          # group index -> its freshly opened trajectories
        self.window = window
        self.max_live_rounds = max_live_rounds
        self.max_staleness = max_staleness
        self.max_turn_tokens = max_turn_tokens
        self.group_size = group_size
        self.groups_opened = 0
        self.waiting: deque[Trajectory] = deque()     # opened or paused, in line for a slot
        self.finished: dict[str, list[Trajectory]] = {}
        self.order: list[str] = []                    # groups in the order they were opened

    def open_group(self) -> None:
        for t in self.next_group(self.groups_opened):
            self.waiting.append(t)
        self.order.append(self.waiting[-1].group_id)
        self.groups_opened += 1

    def _complete(self) -> list[str]:
        return [g for g in self.order if len(self.finished.get(g, ())) == self.group_size]

    def run_step(self, policy: TokenPolicy, step: int, need: int, params: SamplingParams,
                 counters: FifoCounters, drain: bool = False) -> list[list[Trajectory]]:
        """Sample until ``need`` groups are complete (oldest first); those groups, each in sample
        order. What is still live at the end is paused for the next step (``drain``: run every
        started group to its end instead, opening new ones only while fewer than ``need`` are in
        line, and return every complete group, as at the stage's last step)."""
        live: list[Trajectory] = []
        version = policy.version
        round_ = 0
        while True:
            complete = self._complete()
            if len(complete) >= need and (not drain or (not live and not self.waiting)):
                break
            # admission: paused ones first, in line, then new groups: the window stays full (what is
            # still live when the step has its groups goes on in the next step)
            while len(live) < self.window:
                if not self.waiting and (not drain or len(self.order) < need):
                    self.open_group()
                    counters.opened += 1
                if not self.waiting:
                    break
                t = self.waiting.popleft()
                if t.transcript.turns:
                    counters.resumes += 1
                live.append(t)
                t.live_rounds = 0
            if not live:
                break
            budgets = [self.runner.turn_budget(t, self.max_turn_tokens) for t in live]
            contexts = [self.runner.context(t) for t in live]
            completions = self._sample(policy, contexts, budgets, params, step, round_)
            for t, c in zip(live, completions):
                self.runner.apply(t, c, version)
                t.live_rounds += 1
            counters.turns += len(live)
            counters.rounds += 1
            round_ += 1
            still = []
            for t in live:
                if t.done:
                    self.finished.setdefault(t.group_id, []).append(t)
                elif (t.live_rounds >= self.max_live_rounds and self.waiting and not drain
                      and version - (t.versions[0] if t.versions else version) < self.max_staleness):
                    t.pauses += 1
                    counters.pauses += 1
                    self.waiting.append(t)   # to the back of the line, state and all
                else:
                    still.append(t)
            live = still
        for t in live:   # the step is over: what is live waits for newer weights, first in line
            t.pauses += 1
            counters.pauses += 1
        self.waiting.extendleft(reversed(live))
        taken = self._complete() if drain else self._complete()[:need]
        out = []
        for g in taken:
            out.append(sorted(self.finished.pop(g), key=lambda t: t.sample_index))
            self.order.remove(g)
        return out

    def _sample(self, policy: TokenPolicy, contexts: list[list[int]], budgets: list[int], params: SamplingParams,
                step: int, round_: int) -> list[Completion]:
        """One turn for every live trajectory: those with equal budgets in one call, seeded by the
        step, the round and the budget (a rerun samples the same)."""
        out: list[Completion | None] = [None] * len(contexts)
        for budget in sorted(set(budgets)):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            p = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=budget,
                               seed=params.seed * 1_000_003 + step * 7919 + round_ * 31 + budget,
                               repetition_window=None)
            for i, c in zip(rows, policy.sample([contexts[i] for i in rows], p)):
                out[i] = c
        return out

    # -- checkpoint state: everything is in line or finished between steps ----------------
    def state_dict(self) -> dict:
        return {"groups_opened": self.groups_opened, "order": list(self.order),
                "waiting": [t.state_dict() for t in self.waiting],
                "finished": {g: [t.state_dict() for t in ts] for g, ts in self.finished.items()}}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.groups_opened = int(state["groups_opened"])
        self.order = list(state["order"])
        self.waiting = deque(self.runner.restore(s) for s in state["waiting"])
        self.finished = {g: [self.runner.restore(s) for s in ts] for g, ts in state["finished"].items()}


def run_episodes(runner: EpisodeRunner, policy: TokenPolicy, specs: list[EpisodeSpec], samples: int,
                 params: SamplingParams, max_turn_tokens: int, window: int = 64,
                 prefix: str = "eval") -> list[Trajectory]:
    """Every spec played ``samples`` times to its end (evaluation, data): the same FIFO, drained."""
    def group(k: int) -> list[Trajectory]:
        spec = specs[k]
        return [runner.open(f"{prefix}:{spec.task_id}:{i}", f"{prefix}:{spec.task_id}", i, spec) for i in range(samples)]

    fifo = WindowedFIFO(runner, group, window=window, max_live_rounds=10**9, max_staleness=10**9,
                        max_turn_tokens=max_turn_tokens, group_size=samples)
    for k in range(len(specs)):
        fifo.open_group()
    groups = fifo.run_step(policy, 0, len(specs), params, FifoCounters(), drain=True)
    return [t for g in groups for t in g]


def turns_json(t: Trajectory) -> str:
    return json.dumps(t.record, ensure_ascii=False)
