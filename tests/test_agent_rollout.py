"""Multi-turn rollouts: the loss mask is exact (no tool-output or environment token carries loss),
the ids trained on are the ids sampled, turn by turn, and the windowed FIFO pauses, resumes and
restores trajectories without losing or changing one.

The policies are real: a random-init tiny Llama sampling through the local backend, and, where a
test needs known tool calls, the environments' own expert actions fed as completions (named
``expert_completion``: their ids are the demonstration text encoded)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tasks.agents.envs import make_env
from tasks.agents.render import encode_text, render_action
from tasks.agents.rollout import EpisodeRunner, EpisodeSpec, FifoCounters, LocalPolicy, WindowedFIFO
from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend
from tasks.rollout.tiny_model import tiny_llama_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import os

    os.environ.setdefault("POSTTRAIN_HOME", str(tmp_path_factory.mktemp("home")))
    path = tiny_llama_path()
    backend = LocalBackend.from_path(path, LocalConfig(batch_size=16))
    return backend, AutoTokenizer.from_pretrained(path)


def expert_completion(tokenizer, action) -> Completion:
    ids = encode_text(tokenizer, render_action(action)) + [tokenizer.eos_token_id]
    return Completion(render_action(action), ids, [-0.5] * len(ids), "stop")


def _spans(t):
    return {i for turn in t.transcript.turns for i in range(turn.start, turn.end)}


@pytest.mark.parametrize("env_name", ["tool_arithmetic", "feedback", "code_repair"])
def test_the_loss_mask_is_one_exactly_on_sampled_ids_and_never_on_tool_output(tiny, env_name):
    _, tokenizer = tiny
    runner = EpisodeRunner(tokenizer, max_tokens=4096)
    spec = EpisodeSpec(env_name, {}, 3, f"{env_name}:3")
    t = runner.open("t", "g", 0, spec)
    for action in make_env(env_name).expert_actions(3):
        runner.apply(t, expert_completion(tokenizer, action), version=0)
    assert t.success and t.ended == "answered"
    tr = t.transcript
    assert [i for i, m in enumerate(tr.mask) if m] == sorted(_spans(t))
    assert all(tr.mask[i] == 0 for i in range(tr.prompt_length))
    # each observation the environment returned sits in the mask-0 tokens right after the turn it answers
    observations = [m["content"] for m in t.record[1:] if m["role"] in ("tool", "user")]
    assert len(observations) == len(tr.turns) - 1 >= 1
    for k, text in enumerate(observations):
        between = range(tr.turns[k].end, tr.turns[k + 1].start)
        assert all(tr.mask[i] == 0 for i in between)
        assert text.strip() in tokenizer.decode([tr.ids[i] for i in between], skip_special_tokens=False)
    # the sampler's log-probs sit on the sampled ids only
    assert all((lp != 0.0) == bool(m) for lp, m in zip(tr.logprobs, tr.mask))


def test_sampled_ids_are_the_trained_ids_turn_by_turn(tiny):
    """Each turn is sampled from exactly the ids the trajectory holds so far, and the training
    sequence is those ids with the turn's sampled ids appended, never a re-encoded history."""
    backend, tokenizer = tiny
    seen: list[tuple[str, list[int], list[int]]] = []

    class RecordingRunner(EpisodeRunner):
        def apply(self, t, completion, version):
            seen.append((t.trajectory_id, list(self.context(t)), list(completion.token_ids)))
            super().apply(t, completion, version)

    runner = RecordingRunner(tokenizer, max_tokens=512)
    specs = [EpisodeSpec("tool_arithmetic", {}, s, f"ta:{s}") for s in range(3)] + \
        [EpisodeSpec("feedback", {}, s, f"fb:{s}") for s in range(3)]
    from tasks.agents.rollout import run_episodes

    trajs = run_episodes(runner, LocalPolicy(backend), specs, 2, SamplingParams(seed=5), max_turn_tokens=24)
    assert len(trajs) == 12
    by_id = {t.trajectory_id: t for t in trajs}
    multi = 0
    for tid, context, sampled in seen:
        ids = by_id[tid].transcript.ids
        assert ids[:len(context) + len(sampled)] == context + sampled
    for t in trajs:
        (sample_ids, mask, _logp, _), = t.transcript.training_samples(keep_thinking=True)
        assert sample_ids == t.transcript.ids and mask == t.transcript.mask
        turns = [s for tid, _, s in seen if tid == t.trajectory_id]
        assert [t.transcript.ids[u.start:u.end] for u in t.transcript.turns] == turns
        multi += len(turns) > 1
    assert multi > 0, "no trajectory took a second turn: the test saw no multi-turn history"


def test_dropping_thinking_trains_each_turn_on_the_context_it_was_sampled_from(tiny):
    _, tokenizer = tiny
    runner = EpisodeRunner(tokenizer, keep_thinking=False, max_tokens=4096)
    t = runner.open("t", "g", 0, EpisodeSpec("tool_arithmetic", {}, 1, "ta:1"))
    contexts = []
    for action in make_env("tool_arithmetic").expert_actions(1):
        contexts.append(runner.context(t))
        runner.apply(t, expert_completion(tokenizer, action), version=0)
    samples = t.transcript.training_samples(keep_thinking=False)
    assert len(samples) == len(t.transcript.turns) >= 2
    for (ids, mask, _, k), context in zip(samples, contexts):
        turn = t.transcript.turns[k]
        assert ids == context + t.transcript.ids[turn.start:turn.end]
        assert sum(mask) == turn.end - turn.start
    # the second turn's context holds no thinking of the first
    first = t.transcript.turns[0]
    assert first.think_end > first.start
    thinking = tokenizer.decode(t.transcript.ids[first.start:first.think_end])
    assert thinking.strip() and thinking not in tokenizer.decode(contexts[1])


def _fifo(runner, group_size=2, window=3, max_live_rounds=1):
    def group(k):   # uneven lengths: group k's episodes end after at most 2 + k % 3 guesses
        spec = EpisodeSpec("feedback", {"max_turns": 2 + k % 3}, k, f"fb:{k}")
        return [runner.open(f"g{k}:{i}", f"g{k}", i, spec) for i in range(group_size)]
    return WindowedFIFO(runner, group, window=window, max_live_rounds=max_live_rounds, max_staleness=5,
                        max_turn_tokens=16, group_size=group_size)


class _Versioned(LocalPolicy):
    def __init__(self, backend):
        super().__init__(backend, lambda: self.v)
        self.v = 0


def test_the_windowed_fifo_pauses_resumes_and_keeps_every_trajectory(tiny):
    backend, tokenizer = tiny
    runner = EpisodeRunner(tokenizer, max_tokens=512)
    fifo, policy = _fifo(runner), _Versioned(backend)
    params, counters, got = SamplingParams(seed=1), FifoCounters(), []
    for step in range(4):
        policy.v = step
        got += fifo.run_step(policy, step, 1, params, counters)
    assert len(got) == 4 and all(len(g) == 2 and all(t.done for t in g) for g in got)
    assert counters.pauses > 0 and counters.resumes > 0
    # a paused trajectory went on under newer weights: its turns carry more than one version
    assert any(len(set(t.versions)) > 1 for g in got for t in g)
    ids = [t.trajectory_id for g in got for t in g]
    assert len(ids) == len(set(ids))
    # nothing thrown away: every trajectory opened is finished, returned or still in line
    opened = {f"g{k}:{i}" for k in range(fifo.groups_opened) for i in range(2)}
    pending = {t.trajectory_id for t in fifo.waiting} | {t.trajectory_id for ts in fifo.finished.values() for t in ts}
    assert opened == set(ids) | pending


def test_a_restored_fifo_samples_what_an_uninterrupted_one_does(tiny):
    backend, tokenizer = tiny
    runner = EpisodeRunner(tokenizer, max_tokens=512)
    params = SamplingParams(seed=2)

    def play(fifo, steps, start=0):
        out = []
        for step in range(start, steps):
            out += [[(t.trajectory_id, t.transcript.ids, t.outcome) for t in g]
                    for g in fifo.run_step(LocalPolicy(backend), step, 1, params, FifoCounters())]
        return out

    straight = play(_fifo(runner), 4)
    first = _fifo(runner)
    head = play(first, 2)
    state = first.state_dict()
    restored = _fifo(runner)
    restored.load_state_dict(state)
    assert head + play(restored, 4, start=2) == straight


def test_an_openai_compatible_server_drives_the_same_environments(tiny):
    """The real serve-model server (a subprocess on a free port) as the policy, through its text:
    greedy, it plays each held-out episode as the local sampler does (same actions, same verdicts)."""
    from tasks.agents.evaluate import AgentHeldout, evaluate_agent
    from tasks.agents.rollout import TextPolicy, run_episodes
    from tasks.rollout.config import OpenAIConfig
    from tasks.rollout.openai_client import OpenAIBackend
    from tasks.rollout.server import ServerProcess

    backend, tokenizer = tiny
    path = tiny_llama_path()
    specs = [EpisodeSpec("feedback", {"max_turns": 3}, s, f"fb:{s}") for s in range(2)] + \
        [EpisodeSpec("tool_arithmetic", {}, 0, "ta:0")]
    greedy = SamplingParams(temperature=0.0, seed=0)
    local = run_episodes(EpisodeRunner(tokenizer, max_tokens=768), LocalPolicy(backend), specs, 1, greedy, 16)
    with ServerProcess(path, threads=1) as srv:
        client = OpenAIBackend(OpenAIConfig(base_url=srv.base_url, tokenizer=str(path), concurrency=2))
        try:
            remote = run_episodes(EpisodeRunner(tokenizer, max_tokens=768), TextPolicy(client, tokenizer), specs, 1,
                                  greedy, 16)
            scores = evaluate_agent(client, AgentHeldout(environments=[{"name": "feedback"}], seeds=2,
                                                         max_turn_tokens=16, max_tokens=768), 1.0, 1.0, 0)
        finally:
            client.close()
    assert [t.actions for t in remote] == [t.actions for t in local]
    assert [(t.ended, t.outcome) for t in remote] == [(t.ended, t.outcome) for t in local]
    assert all(t.done and len(t.transcript.turns) >= 1 for t in remote)
    assert [(s.benchmark, s.n) for s in scores] == [("agent/feedback", 1)] * 2
