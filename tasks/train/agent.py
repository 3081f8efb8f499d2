"""The agent stage (MiniMax-M2 -> M2.5): CISPO over multi-turn tool-use trajectories.

One step: the windowed FIFO (``tasks.agents.rollout``) plays environment episodes with the
trainer's own module until ``tasks_per_step`` groups of ``group_size`` trajectories of one task
are complete (paused ones from the step before resume first, under these newer weights) -> each
trajectory's reward from its components (outcome, per-step process reward, a task-completion-time
cost per turn; reward-to-go per turn where set) -> group advantages per task -> the training
sequences (a trajectory's ids as sampled, the loss mask 1 only on the policy's own tokens) run
forward once over their prefix trie (a group's shared prompt and shared earlier turns encoded
once) -> CISPO against the sampler's log-probs for turns sampled by older weights (their
staleness corrected by the clipped importance weight, never thrown away), the trainer's own for
this step's.

``expert_steps`` first: agent SFT on the environments' scripted solutions (M2 trains agent
data before RL), rendered through the same template and tool format, so the policy knows the
format before RL rewards it.

The trajectories go to the ``trajectories`` table at each checkpoint and at the end; the FIFO's
state (every trajectory in line, with its ids, record and actions) rides in the checkpoint, so a
killed stage resumes to the trajectories an uninterrupted run samples.
"""
from __future__ import annotations

import json
import logging
import math
import time

import polars as pl
import torch

from model.losses import group_advantages, policy_loss
from model.trie import trie_logprobs
from tasks.agents.envs import make_env
from tasks.agents.render import (
    ToolRenderer,
    Transcript,
    encode_text,
    render_action,
    thinking_tokens,
)
from tasks.agents.rollout import (
    EpisodeRunner,
    EpisodeSpec,
    FifoCounters,
    LocalPolicy,
    Trajectory,
    WindowedFIFO,
)
from tasks.model_registry import audited_row
from tasks.rollout.base import SamplingParams
from tasks.rollout.config import LocalConfig
from tasks.rollout.local import LocalBackend
from tasks.train.encoding import encode_prompt
from tasks.train.engine import backward_and_step, current_lr, lr_lambda, set_lr_factor, world_size
from tasks.train.harness import StageHarness, handed_ref
from warehouse import Warehouse

log = logging.getLogger("posttrain.train.agent")


# --------------------------------------------------------------------------- rewards

def reward_components(t: Trajectory, process_coef: float, time_cost: float) -> tuple[float, list[float], float]:
    """(reward, reward-to-go per turn, time cost): outcome + process_coef x the process rewards
    - time_cost x turns; turn k's reward-to-go counts the outcome, the process rewards from k on
    and the cost of the turns from k on."""
    turns = len(t.transcript.turns)
    process = [process_coef * r for r in t.process_rewards] + [0.0] * max(0, turns - len(t.process_rewards))
    cost = time_cost * turns
    to_go = [t.outcome + sum(process[k:]) - time_cost * (turns - k) for k in range(turns)]
    return t.outcome + sum(process) - cost, to_go, cost


def token_advantages(groups: list[list[Trajectory]], cfg) -> tuple[list[float], list[list[list[float]]]]:
    """Each trajectory's reward, and per trajectory per turn the advantage its tokens carry: the
    group-normalized reward (M1/GRPO), or with ``reward_to_go`` each turn's return-to-go minus the
    group's mean reward, over the group's reward spread."""
    rewards, per_turn = [], []
    for group in groups:
        comps = [reward_components(t, cfg.process_reward, cfg.time_cost) for t in group]
        r = torch.tensor([c[0] for c in comps], dtype=torch.float64)
        adv = group_advantages(r, len(group))
        mean, std = r.mean().item(), r.std(unbiased=False).item()
        for t, (reward, to_go, _), a in zip(group, comps, adv.tolist()):
            rewards.append(reward)
            if cfg.reward_to_go:
                per_turn.append([(g - mean) / (std + 1e-6) if std > 0 else 0.0 for g in to_go])
            else:
                per_turn.append([a] * len(t.transcript.turns))
    return rewards, per_turn


# --------------------------------------------------------------------------- the loss over the trie

def sequence_loss(module, samples: list[dict], cfg, trainer_version: int, eps_high: float,
                  max_tokens_per_row: int | None) -> tuple[torch.Tensor, dict]:
    """CISPO over ``samples`` (each: ids, mask, sampler log-probs, per-token advantage and policy
    version, group), its log-probs from one trie forward; each task group reduced by the stage's
    ``normalization`` (CISPO's own: the group's token count, M1's token-level normalization),
    groups averaged."""
    out = trie_logprobs(module, [s["ids"] for s in samples], max_tokens_per_row=max_tokens_per_row)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s["group"], []).append(i)
    losses, stats_sum, gap_num, gap_den = [], {}, 0.0, 0.0
    for rows in groups.values():
        width = max(len(samples[i]["ids"]) for i in rows) - 1
        logp = torch.zeros(len(rows), width)
        old = torch.zeros(len(rows), width)
        adv = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width)
        fresh = torch.zeros(len(rows), width, dtype=torch.bool)
        for j, i in enumerate(rows):
            s, n = samples[i], len(samples[i]["ids"]) - 1
            logp[j, :n] = out.logp[i]
            mask[j, :n] = torch.tensor(s["mask"][1:], dtype=torch.float32)
            old[j, :n] = torch.tensor(s["logprobs"][1:], dtype=torch.float32)
            adv[j, :n] = torch.tensor(s["advantages"][1:], dtype=torch.float32)
            fresh[j, :n] = torch.tensor([v == trainer_version for v in s["versions"][1:]])
        # this step's own tokens: the trainer's log-probs are the behaviour policy (ratio 1, exact
        # gradient); older weights' tokens: the sampler's reported ones (the CISPO weight corrects them)
        gap_num += float(((logp.detach() - old).abs() * mask * fresh).sum())
        gap_den += float((mask * fresh).sum())
        behaviour = torch.where(fresh, logp.detach(), old)
        loss, stats = policy_loss(cfg.loss, logp, behaviour, adv, mask, cfg.eps_low, eps_high,
                                  normalization=cfg.normalization)
        losses.append(loss)
        for k, v in stats.items():
            stats_sum[k] = stats_sum.get(k, 0.0) + v / len(groups)
    stats_sum.update(trie_tokens=float(out.trie_tokens), sequence_tokens=float(out.tokens),
                     trie_ratio=out.tokens / max(1, out.trie_tokens),
                     train_infer_logprob_gap=gap_num / gap_den if gap_den else 0.0)
    return torch.stack(losses).mean(), stats_sum


def sft_loss_over_trie(module, samples: list[dict], max_tokens_per_row: int | None) -> tuple[torch.Tensor, dict]:
    """Token-mean negative log-likelihood of the masked tokens (agent SFT on expert trajectories)."""
    out = trie_logprobs(module, [s["ids"] for s in samples], max_tokens_per_row=max_tokens_per_row)
    total, count = 0.0, 0.0
    for s, logp in zip(samples, out.logp):
        m = torch.tensor(s["mask"][1:], dtype=torch.float32)
        total = total - (logp * m).sum()
        count += float(m.sum())
    return total / max(count, 1.0), {"trie_ratio": out.tokens / max(1, out.trie_tokens)}


def training_samples(t: Trajectory, advantages: list[float], keep_thinking: bool) -> list[dict]:
    """The sequences a trajectory trains as, with per-token advantages and policy versions."""
    per_token_turn = t.transcript.turn_of_token()
    versions_of_turn = [turn.version if turn.version is not None else -1 for turn in t.transcript.turns]
    out = []
    for ids, mask, logp, first_turn in t.transcript.training_samples(keep_thinking):
        if keep_thinking:
            turn_of = per_token_turn
        else:   # one turn's sample: its tokens are that turn's
            turn_of = [first_turn] * len(ids)
        adv = [advantages[k] if k >= 0 and m else 0.0 for k, m in zip(turn_of, mask)]
        ver = [versions_of_turn[k] if k >= 0 else -1 for k in turn_of]
        out.append({"ids": ids, "mask": mask, "logprobs": logp, "advantages": adv, "versions": ver,
                    "group": t.group_id})
    return out


# --------------------------------------------------------------------------- expert demonstrations

def expert_trajectory(tokenizer, spec: EpisodeSpec, trajectory_id: str) -> Trajectory | None:
    """The environment's scripted solution, played through the environment and rendered with the
    same template and tool format the policy samples under (its ids are the demonstration text
    encoded: what the policy is taught to write), mask 1 on the assistant turns."""
    env = make_env(spec.environment, **spec.settings)
    actions = env.expert_actions(spec.seed)
    if not actions:
        return None
    reset = env.reset(spec.seed)
    renderer = ToolRenderer(tokenizer, reset.tools)
    t = Trajectory(trajectory_id, trajectory_id, 0, spec, Transcript(), [dict(m) for m in reset.messages],
                   [dict(m) for m in reset.messages])
    ids = encode_text(tokenizer, renderer.render(t.messages, add_generation_prompt=True))
    t.transcript.extend_env(ids)
    t.transcript.prompt_length = len(ids)
    for action in actions:
        text = render_action(action)
        turn = encode_text(tokenizer, text) + [tokenizer.eos_token_id]
        t.transcript.extend_policy(turn, None, thinking_tokens(tokenizer, turn), None)
        t.messages.append({"role": "assistant", "content": text})
        t.record.append({"role": "assistant", "content": action.text, "thinking": action.thinking,
                         "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in action.tool_calls]})
        t.actions.append(text)
        result = env.step(action)
        t.process_rewards.append(float(result.reward))
        t.tool_calls += len(action.tool_calls)
        t.record.extend(result.observation)
        if result.done:
            t.ended, t.outcome, t.success = result.info.get("ended", "answered"), float(result.info["outcome"]), \
                bool(result.info["success"])
            break
        t.transcript.extend_env(encode_text(tokenizer, renderer.bridge(t.messages, result.observation,
                                                                        tokenizer.eos_token)))
        t.messages.extend(result.observation)
    env.close()
    return t if t.success else None


# --------------------------------------------------------------------------- replay

def replay_pool(h: StageHarness, tokenizer) -> list[dict]:
    """The single-turn sequences the stage rehearses (``replay_batch``): the verified samples
    (reward 1) the RL stage of the run its starting model comes from drew from its own prompts,
    one per distinct (prompt, completion), each as that RL stage trained it (the prompt rendered by
    ``encode_prompt``, the completion's ids as sampled), the loss mask on the completion. Read from
    the ``rl_rollouts`` and ``rl_prompts`` snapshots the stage was handed."""
    rollouts, prompts = handed_ref(h, "rl_rollouts"), handed_ref(h, "rl_prompts")
    wh = Warehouse(h.job.home)
    row = audited_row(wh, h.job.init_model)
    run = row["run_name"] if row else h.job.run_name
    if rollouts is None or prompts is None:
        raise ValueError(f"agent.replay_batch {h.stage_cfg.replay_batch}: no rl_rollouts / rl_prompts in "
                         f"{h.job.home} to replay; train the rl stage of run {run!r} first, or set replay_batch 0")
    text = wh.read(prompts.name, prompts.snapshot).select("prompt_id", "prompt")
    rows = (wh.read(rollouts.name, rollouts.snapshot)
            .filter((pl.col("train_run") == run) & (pl.col("reward") >= 1.0) & pl.col("token_ids").is_not_null())
            .join(text, on="prompt_id", how="inner")
            .unique(subset=["prompt_id", "text"], keep="first").sort("rollout_id"))
    if rows.is_empty():
        raise ValueError(f"agent.replay_batch {h.stage_cfg.replay_batch}: run {run!r} has no verified RL sample in "
                         f"{rollouts} (with its prompt in {prompts}) to replay; set replay_batch 0")
    out = []
    for r in rows.iter_rows(named=True):
        prompt = encode_prompt(tokenizer, r["prompt"], r["domain"])
        completion = list(r["token_ids"])
        out.append({"ids": prompt + completion, "mask": [0] * len(prompt) + [1] * len(completion)})
    return out


def step_with_replay(h: StageHarness, engine, loss: torch.Tensor, pool: list[dict], step: int
                     ) -> tuple[float | None, dict]:
    """One optimizer step on ``loss`` plus the weighted NLL of ``replay_batch`` sequences of
    ``pool`` drawn for ``step`` (seeded); the gradient norm and the replay's metrics (none without
    replay)."""
    cfg = h.stage_cfg
    if not pool or not cfg.replay_batch:
        return backward_and_step(engine, loss), {}
    g = torch.Generator().manual_seed(h.cfg.seed * 37 + step)
    picked = [pool[i] for i in torch.randint(len(pool), (cfg.replay_batch,), generator=g).tolist()]
    rehearsal, _ = sft_loss_over_trie(engine.module, picked, cfg.max_tokens_per_row)
    norm = backward_and_step(engine, loss + cfg.replay_weight * rehearsal)
    return norm, {"replay_loss": rehearsal.item(), "replay_sequences": float(len(picked))}


# --------------------------------------------------------------------------- the table

def trajectory_row(h: StageHarness, t: Trajectory, step: int, kind: str, reward: float, to_go: list[float],
                   time_cost: float, trainer_version: int, model: str) -> dict:
    tr = t.transcript
    versions = t.versions
    return {
        "trajectory_id": t.trajectory_id, "train_run": h.job.run_name, "stage": h.job.stage, "kind": kind,
        "step": step, "group_id": t.group_id, "task_id": t.spec.task_id, "environment": t.spec.environment,
        "seed": t.spec.seed, "sample_index": t.sample_index, "turns": json.dumps(t.record, ensure_ascii=False),
        "token_ids": tr.ids, "loss_mask": tr.mask, "sampler_logprobs": tr.logprobs,
        "turn_spans": json.dumps([[u.start, u.end, u.think_end, u.version] for u in tr.turns]),
        "prompt_tokens": tr.prompt_length, "num_tokens": len(tr.ids), "trained_tokens": int(sum(tr.mask)),
        "num_turns": len(tr.turns), "num_tool_calls": t.tool_calls, "num_tool_errors": t.tool_errors,
        "outcome": t.outcome, "success": t.success, "process_rewards": t.process_rewards, "time_cost": time_cost,
        "reward": reward, "reward_to_go": to_go, "ended": t.ended or "max_turns",
        "keep_thinking": h.stage_cfg.keep_thinking, "pauses": t.pauses,
        "policy_version": versions[0] if versions else trainer_version,
        "policy_version_last": versions[-1] if versions else trainer_version,
        "staleness": trainer_version - versions[0] if versions else 0,
        "model": model, "run_id": h.job.mlflow_run_id}


def _stored_ids(h: StageHarness) -> set[str]:
    wh = Warehouse(h.job.home)
    if not wh.exists("trajectories"):
        return set()
    rows = wh.scan("trajectories").filter(pl.col("train_run") == h.job.run_name).select("trajectory_id").collect()
    return set(rows["trajectory_id"].to_list())


def _store(h: StageHarness, rows: list[dict], stored: set[str]) -> None:
    """Append the pending trajectories, each once (an expert demonstration picked at several steps,
    or one a killed run stored already, is not stored again)."""
    rows = list({r["trajectory_id"]: r for r in reversed(rows) if r["trajectory_id"] not in stored}.values())[::-1]
    if rows:
        from data_specs import get_spec

        Warehouse(h.job.home).append("trajectories", get_spec("trajectories").conform(pl.DataFrame(rows)),
                                     parents=[h.job.data_ref])
        stored.update(r["trajectory_id"] for r in rows)


# --------------------------------------------------------------------------- the stage

def episode_specs(h: StageHarness) -> list[EpisodeSpec]:
    return [EpisodeSpec(r["environment"], json.loads(r["settings"]), int(r["seed"]), r["task_id"])
            for r in h.read_data().sort("task_id").iter_rows(named=True)]


def task_order(specs: list[EpisodeSpec], seed: int, count: int) -> list[int]:
    """The tasks groups are opened for, in order: seeded permutations, epoch after epoch."""
    out, epoch = [], 0
    while len(out) < count:
        g = torch.Generator().manual_seed(seed * 7_919 + epoch)
        out += torch.randperm(len(specs), generator=g).tolist()
        epoch += 1
    return out[:count]


def two_phase_factor(optimizer_cfg, cfg, lr: float):
    """The agent stage's lr factor with ``expert_lr``: the expert steps at expert_lr (after the
    warm-up), then the optimizer's schedule over the RL steps alone, from its own warm-up."""
    expert = lr_lambda(optimizer_cfg.model_copy(update={"schedule": "constant"}), cfg.expert_steps)
    rl = lr_lambda(optimizer_cfg, cfg.steps - cfg.expert_steps)

    def factor(step: int) -> float:
        if step < cfg.expert_steps:
            return expert(step) * cfg.expert_lr / lr
        return rl(step - cfg.expert_steps)

    return factor


def train_agent(h: StageHarness) -> dict:
    cfg = h.stage_cfg
    if world_size() > 1:
        raise ValueError("the agent stage trains on one rank (rank 0 plays the episodes with its own module)")
    model, tokenizer = h.load_policy()
    engine = h.create_engine(model)
    if cfg.expert_lr is not None and cfg.expert_steps:
        set_lr_factor(engine, two_phase_factor(h.cfg.optimizer, cfg, h.cfg.stage_lr(h.job.stage)))
    start, state = h.resume(engine)
    specs = episode_specs(h)
    runner = EpisodeRunner(tokenizer, keep_thinking=cfg.keep_thinking, max_tokens=cfg.max_tokens)
    rl_steps = cfg.steps - cfg.expert_steps
    order = task_order(specs, h.cfg.seed, max(1, rl_steps) * cfg.tasks_per_step * 4 + len(specs))

    def next_group(k: int) -> list[Trajectory]:
        spec = specs[order[k % len(order)]]
        gid = f"agent:{h.job.run_name}:g{k}"
        return [runner.open(f"{gid}:{i}", gid, i, spec) for i in range(cfg.group_size)]

    fifo = WindowedFIFO(runner, next_group, window=cfg.window, max_live_rounds=cfg.max_live_rounds,
                        max_staleness=cfg.max_staleness, max_turn_tokens=cfg.max_turn_tokens,
                        group_size=cfg.group_size)
    fifo.load_state_dict(state.get("fifo"))
    backend = LocalBackend(engine.module, tokenizer, LocalConfig(batch_size=cfg.window))
    policy = LocalPolicy(backend, lambda: engine.global_steps)
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=h.cfg.seed)
    demos = [expert_trajectory(tokenizer, s, f"expert:{h.job.run_name}:{s.task_id}")
             for s in (specs if cfg.expert_steps else [])]
    experts = [t for t in demos if t is not None]
    if cfg.expert_steps and not experts:
        raise ValueError("agent.expert_steps > 0 but no environment of agent_tasks gives expert actions")
    replay = replay_pool(h, tokenizer) if cfg.replay_batch else []
    if replay:
        log.info("agent: rehearsing %d of %d verified RL samples at every step (weight %s)", cfg.replay_batch,
                 len(replay), cfg.replay_weight)
    stored, pending, last = _stored_ids(h), [], {}
    model_name = f"{h.job.run_name}/{h.job.stage}"
    for step in range(start, cfg.steps):
        started = time.monotonic()
        version = int(engine.global_steps)
        if step < cfg.expert_steps:
            g = torch.Generator().manual_seed(h.cfg.seed * 31 + step)
            picked = [experts[i] for i in torch.randint(len(experts), (cfg.expert_batch,), generator=g).tolist()]
            samples = [s for t in picked for s in training_samples(t, [1.0] * len(t.transcript.turns), True)]
            loss, stats = sft_loss_over_trie(engine.module, samples, cfg.max_tokens_per_row)
            norm, replay_stats = step_with_replay(h, engine, loss, replay, step)
            metrics = {"loss": loss.item(), "expert_sft": 1.0, "grad_norm": norm or 0.0, "lr": current_lr(engine), **stats,
                       **replay_stats}
            if step == cfg.expert_steps - 1 or step == 0:
                for t in {t.trajectory_id: t for t in picked}.values():
                    reward, to_go, cost = reward_components(t, cfg.process_reward, cfg.time_cost)
                    pending.append(trajectory_row(h, t, step, "expert", reward, to_go, cost, version, "expert"))
        else:
            counters = FifoCounters()
            groups = fifo.run_step(policy, step, cfg.tasks_per_step, params, counters, drain=step == cfg.steps - 1)
            sampled_at = time.monotonic()
            rewards, per_turn = token_advantages(groups, cfg)
            trajs = [t for g in groups for t in g]
            # dynamic sampling: a group whose rewards all agree has no advantage to train on
            informative = {g[0].group_id for g in groups if len({round(r, 9) for r in
                           (reward_components(t, cfg.process_reward, cfg.time_cost)[0] for t in g)}) > 1}
            samples = []
            for t, adv in zip(trajs, per_turn):
                if not cfg.dynamic_sampling or t.group_id in informative:
                    samples += training_samples(t, adv, cfg.keep_thinking)
            metrics = {**counters.metrics(), **_trajectory_metrics(trajs, rewards, version),
                       "groups_informative": float(len(informative)), "trained_sequences": float(len(samples)),
                       "sampling_seconds": sampled_at - started,
                       "lr": current_lr(engine)}
            if samples:
                loss, stats = sequence_loss(engine.module, samples, cfg, version, cfg.eps_high, cfg.max_tokens_per_row)
                norm, replay_stats = step_with_replay(h, engine, loss, replay, step)
                metrics.update(loss=loss.item(), grad_norm=norm or 0.0, **stats, **replay_stats)
            for t, reward in zip(trajs, rewards):
                _, to_go, cost = reward_components(t, cfg.process_reward, cfg.time_cost)
                pending.append(trajectory_row(h, t, step, "policy", reward, to_go, cost, version,
                                              f"{model_name}@update{version}"))
        metrics["step_seconds"] = time.monotonic() - started
        h.record(step, metrics)
        last = metrics
        if h.checkpoint_due(step):
            if h.is_rank0:
                _store(h, pending, stored)
            pending = []
            h.maybe_checkpoint(engine, step, {"fifo": fifo.state_dict()})
        if h.is_rank0:
            log.info("agent step %d: %s", step, ", ".join(f"{k}={v:.3g}" for k, v in metrics.items()
                                                         if k in ("loss", "success_rate", "reward_mean", "turns_mean")))
    if h.is_rank0:
        _store(h, pending, stored)
    return h.finish(engine, tokenizer, {"final_loss": last.get("loss"), "final_success_rate": last.get("success_rate"),
                                        "tasks": len(specs), "expert_demonstrations": len(experts),
                                        "replay_pool": len(replay)},
                    curves=("loss", "success_rate", "reward_mean", "turns_mean", "tool_errors_mean"))


def _trajectory_metrics(trajs: list[Trajectory], rewards: list[float], version: int) -> dict[str, float]:
    n = max(1, len(trajs))
    tokens = sum(len(t.transcript.ids) for t in trajs)
    trained = sum(sum(t.transcript.mask) for t in trajs)
    lags = [version - t.versions[0] for t in trajs if t.versions]
    out = {"success_rate": sum(t.success for t in trajs) / n, "reward_mean": sum(rewards) / n,
           "outcome_mean": sum(t.outcome for t in trajs) / n,
           "process_reward_mean": sum(sum(t.process_rewards) for t in trajs) / n,
           "turns_mean": sum(len(t.transcript.turns) for t in trajs) / n,
           "tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
           "tool_errors_mean": sum(t.tool_errors for t in trajs) / n,
           "masked_token_share": trained / max(1, tokens),
           "staleness_max": float(max(lags, default=0)), "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
           "paused_trajectories": float(sum(t.pauses > 0 for t in trajs)),
           "trajectory_tokens_mean": tokens / n}
    for reason in ("answered", "max_turns", "max_tokens", "tool_error", "timeout"):
        out[f"ended_{reason}"] = sum(t.ended == reason for t in trajs) / n
    if any(math.isnan(v) for v in out.values()):
        raise ValueError(f"agent metrics hold NaN: {out}")
    return out
