"""Online RL stage: CISPO (or GRPO / DAPO) with curriculum and staged length extension.

One step: draw prompts (curriculum) -> sample a group of completions per prompt from the
*current* policy (the sampler holds the engine's own module, so its weights are the
trained ones at every step) -> rewards by domain (verifiers for math/logic/code, the
GenRM against the prompt's reference for general/instruction, one batched judge call per
sampling round) -> drop groups whose rewards are all equal (dynamic sampling) -> group
advantages -> log-probs of the behaviour policy (with ``prefix_shared``, every forward encodes
each distinct prompt once for all its responses) -> ``updates_per_batch`` optimizer steps
over minibatches of groups, all of them ``epochs_per_batch`` times (the first update
on-policy, the rest off-policy, which is where CISPO's clipped importance weight matters:
PPO's clip drops a token's gradient once its ratio leaves the band) -> gates of the length schedule -> the
length-bias monitor (reward vs response length at fixed correctness), whose events end up
in the stage summary for the flow to act on.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import time
from collections.abc import Callable

import polars as pl
import torch

from data_specs import get_spec
from model.config import IGNORE_INDEX
from model.logprobs import SharedLogprobs, response_logprobs
from model.losses import (
    group_advantages,
    informative_groups,
    masked_mean,
    policy_loss,
    truncated_is_weights,
)
from tasks.genrm.length_bias import LengthBiasMonitor, LengthCorrection
from tasks.genrm.references import current_references
from tasks.rollout.base import RolloutBackend, SamplingParams
from tasks.rollout.config import RolloutConfig
from tasks.train.curriculum import AdaptiveLevels, Curriculum, WindowRefresh, level_mix
from tasks.train.encoding import encode_prompt, pad_batch, pad_id_of, prompt_text
from tasks.train.engine import (
    backward_and_step,
    broadcast_from_rank0,
    current_lr,
    rank,
    set_gradient_clipping,
    sum_across_ranks,
    world_size,
)
from tasks.train.genrm_reward import DomainReward, RewardCounters, RewardFn, references_by_prompt
from tasks.train.harness import StageHarness, handed_ref
from tasks.train.length_schedule import LengthSchedule
from tasks.train.rollout_engine import make_sampler
from warehouse import Warehouse

log = logging.getLogger("posttrain.train.rl")

JudgeFactory = Callable[[], RolloutBackend]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


class RolloutBatch:
    """Completions of the kept groups, flattened group by group, with their rewards."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.rows: list[dict] = []          # the pool row of each completion
        self.completions: list = []
        self.rewards: list[float] = []

    def add_group(self, row: dict, completions, rewards: list[float]) -> None:
        self.rows.extend([row] * len(completions))
        self.completions.extend(completions)
        self.rewards.extend(rewards)

    @property
    def num_groups(self) -> int:
        return len(self.rewards) // self.group_size


def _sample_groups(h: StageHarness, sampler, pool: list[dict], curriculum: Curriculum,
                   step: int, max_tokens: int, rewarder: DomainReward, tokenizer) -> tuple[RolloutBatch, dict, list]:
    """Sample until ``prompts_per_step`` informative groups are kept or the rounds run out.

    Each round is scored as a whole, so its GenRM samples form one judge call; a further
    round is drawn only when dynamic sampling dropped groups, which needs those rewards.
    """
    cfg = h.stage_cfg
    kept = RolloutBatch(cfg.group_size)
    counters = RewardCounters()
    all_rewards, all_lengths, sampled_logps, truncated, seen = [], [], [], 0, []
    sampling_s = scoring_s = 0.0
    for round_ in range(cfg.max_sampling_rounds):
        need = cfg.prompts_per_step - kept.num_groups
        if need <= 0:
            break
        rows, prompts, params = _round_request(h, pool, curriculum, step, round_, need, max_tokens, tokenizer)
        started = time.monotonic()
        groups = sampler.generate(step, round_, prompts, params)
        scored_at = time.monotonic()
        scored_groups = rewarder.score(rows, groups, counters, step, round_)
        sampling_s, scoring_s = sampling_s + scored_at - started, scoring_s + time.monotonic() - scored_at
        for row, completions, scored in zip(rows, groups, scored_groups):
            rewards = [s.reward for s in scored]
            seen.append((row, completions, scored, round_))
            all_rewards.extend(rewards)
            all_lengths.extend(len(c.token_ids) for c in completions)
            truncated += sum(c.truncated for c in completions)
            for c in completions:   # the tokens whose log-prob the sampler reported
                sampled_logps.extend(x for x in c.logprobs or [] if x is not None)
            informative = informative_groups(torch.tensor(rewards), cfg.group_size).item()
            if (informative or not cfg.dynamic_sampling) and kept.num_groups < cfg.prompts_per_step:
                kept.add_group(row, completions, rewards)
    n = max(1, len(all_rewards))
    mean_reward = sum(all_rewards) / n
    stats = {
        "reward_mean": mean_reward,
        "reward_std": math.sqrt(sum((r - mean_reward) ** 2 for r in all_rewards) / n),
        "response_length_p50": percentile(all_lengths, 0.5),
        "response_length_p99": percentile(all_lengths, 0.99),
        # perplexity of the generated sequences under the sampler: the first length gate
        "generation_perplexity": math.exp(-sum(sampled_logps) / len(sampled_logps)) if sampled_logps else float("nan"),
        "truncated_fraction": truncated / n,
        "groups_kept": float(kept.num_groups),
        # dynamic sampling's shortfall: the update trains on fewer groups (see ``_micro_batches``)
        "groups_shortfall": float(cfg.prompts_per_step - kept.num_groups),
        "groups_sampled": float(len(seen)),
        # where rank 0's step time went: waiting for the step's rollouts (no wait for a batch sampled
        # ahead that is ready), and rewarding them
        "sampling_seconds": sampling_s, "scoring_seconds": scoring_s,
        **level_mix([row for row, *_ in seen]),   # the synthetic prompts' levels drawn this step
        **counters.metrics(),
    }
    return kept, stats, seen


def _round_request(h: StageHarness, pool: list[dict], curriculum: Curriculum, step: int, round_: int, need: int,
                   max_tokens: int, tokenizer) -> tuple[list[dict], list[str], SamplingParams]:
    """What a sampling round asks for: its pool rows (the curriculum's draw for the step and
    round), their prompts and the sampling settings (seeded by step and round)."""
    cfg = h.stage_cfg
    rows = [pool[i] for i in curriculum.sample(step, need, round_)]
    params = SamplingParams(
        n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=max_tokens,
        seed=h.cfg.seed * 1_000_003 + step * 31 + round_,
        repetition_window=min(cfg.repetition_window, max_tokens) if cfg.repetition_window else None,
        repetition_prob=cfg.repetition_prob)
    return rows, [prompt_text(tokenizer, r["prompt"], r["domain"]) for r in rows], params


def _sample_ahead(h: StageHarness, sampler, pool: list[dict], curriculum: Curriculum, step: int, max_tokens: int,
                  rewarder: DomainReward, tokenizer) -> None:
    """Rank 0, once ``step``'s own sampling is done: have the engine sample the first round of the
    steps up to ``batches_ahead`` ahead (those not yet asked for) while this step trains, and
    their verifier verdicts decided as they come in."""
    cfg = h.stage_cfg
    for ahead in range(step + 1, min(step + sampler.ahead, cfg.steps - 1) + 1):
        rows, prompts, params = _round_request(h, pool, curriculum, ahead, 0, cfg.prompts_per_step, max_tokens,
                                               tokenizer)
        sampler.sample_ahead(ahead, prompts, params, then=functools.partial(rewarder.verify_ahead, ahead, rows))


def _staleness(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """How many versions behind the trainer's the kept samples' first tokens are, and how many
    samples went on under a later version (partial rollouts)."""
    lags = [trainer_version - c.policy_version for c in batch.completions if c.policy_version is not None]
    return {"policy_staleness": float(max(lags, default=0)),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "partial_rollouts": float(sum(c.version_boundary is not None for c in batch.completions))}


def _monitor_inputs(seen: list) -> tuple[list[float], list[int], list[float]]:
    """(reward, response length, correctness) of every judged sample drawn in the step.

    Verifier-scored samples are left out: their reward is their correctness, so they carry
    no length signal and would only dilute the statistic and the fitted correction. So are
    GenRM samples whose verdict was not read (unparseable, no reference): their correctness
    is unknown, and the tie they are paid says nothing of their length. So are graded samples
    (``grade_domains``): the correction the monitor's events fit applies to pairwise rewards only.
    """
    rewards, lengths, correct = [], [], []
    for _row, completions, scored, _round in seen:
        for c, s in zip(completions, scored):
            if s.scorer in ("verifier", "genrm_grade") or s.correct is None:
                continue
            rewards.append(s.reward)
            lengths.append(len(c.token_ids))
            correct.append(s.correct)
    return rewards, lengths, correct


def _training_tensors(batch: RolloutBatch, tokenizer, prompt_cache: dict[str, list[int]], pad: int) -> dict:
    seqs, prompt_lengths = [], []
    for row, completion in zip(batch.rows, batch.completions):
        ids = prompt_cache.setdefault(row["prompt_id"], encode_prompt(tokenizer, row["prompt"], row["domain"]))
        seqs.append(ids + list(completion.token_ids))
        prompt_lengths.append(len(ids))
    tensors = pad_batch(seqs, prompt_lengths, pad)
    tensors["mask"] = (tensors["labels"][:, 1:] != IGNORE_INDEX).float()
    # the sampler's own log-prob of each response token, aligned with the trainer's, and where it
    # is known (a backend may report none, or leave a token's out)
    sampler, known = torch.zeros_like(tensors["mask"]), torch.zeros_like(tensors["mask"])
    for row, (completion, n_prompt) in enumerate(zip(batch.completions, prompt_lengths)):
        if completion.logprobs:
            at = slice(n_prompt - 1, n_prompt - 1 + len(completion.logprobs))
            sampler[row, at] = torch.tensor([x if x is not None else 0.0 for x in completion.logprobs])
            known[row, at] = torch.tensor([float(x is not None) for x in completion.logprobs])
    tensors["sampler_logp"], tensors["sampler_logp_known"] = sampler, known * tensors["mask"]
    return tensors


def _minibatches(num_groups: int, group_size: int, updates: int) -> list[list[int]]:
    """Row indices of each update: whole groups, so CISPO's per-group normalization holds.

    Exactly ``min(updates, num_groups)`` minibatches whose sizes differ by at most one group
    (dynamic sampling may keep fewer groups than asked for; a ceil-sized split lost updates).
    """
    updates = max(1, min(updates, num_groups))
    base, extra = divmod(num_groups, updates)
    out, start = [], 0
    for u in range(updates):
        stop = start + base + (u < extra)
        out.append([g * group_size + i for g in range(start, stop) for i in range(group_size)])
        start = stop
    return out


def _micro_batches(rows: list[int], accumulation: int) -> list[list[int]]:
    """This rank's micro-batches of a minibatch: the minibatch in ``accumulation`` x ranks slices
    whose sizes differ by at most one response, of which each rank takes ``accumulation``
    consecutive ones; DeepSpeed steps after exactly that many backwards on every rank.

    Dynamic sampling may keep fewer groups than asked for, so an update's responses need not
    divide evenly (M1's group 16 over 16 x 8 slices takes whole multiples of 8 groups): slices
    then differ by one response, which costs nothing in exactness, because each micro-batch's
    loss is the minibatch's loss with the other rows held constant. A slice left with no
    response at all (fewer responses than slices) is an empty list: its rank still runs one
    forward and backward there, of a stand-in row at weight zero, so every rank takes its
    ``accumulation`` backwards and ZeRO-3 gathers the weights in step with the other ranks.
    The step metrics say how often either happened (``split_accounting``).
    """
    sizes = _slice_sizes(len(rows), accumulation * world_size())
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    mine = range(rank() * accumulation, (rank() + 1) * accumulation)
    return [rows[starts[i]:starts[i] + sizes[i]] for i in mine]


def _slice_sizes(n_rows: int, parts: int) -> list[int]:
    """``n_rows`` in ``parts`` consecutive slices, the first ``n_rows % parts`` one row larger."""
    base, extra = divmod(n_rows, parts)
    return [base + (i < extra) for i in range(parts)]


# the row an empty micro-batch's behaviour pass runs and discards (any row of the batch will do)
_STAND_IN = 0


def split_accounting(plan_rows: list[list[int]], accumulation: int) -> dict[str, float]:
    """What splitting the step's updates into micro-batches had to do, over every rank:
    ``uneven_updates`` (updates whose responses do not split into accumulation x ranks equal
    micro-batches) and ``zero_weight_micro_batches`` (slices with no response of their own)."""
    parts = accumulation * world_size()
    return {"uneven_updates": float(sum(len(rows) % parts != 0 for rows in plan_rows)),
            "zero_weight_micro_batches": float(sum(max(0, parts - len(rows)) for rows in plan_rows))}


def _policy_logprobs(module, tensors: dict, rows: list[int], prefix_shared: bool) -> SharedLogprobs:
    """Log-probs of ``rows``' responses: each distinct prompt encoded once and shared by its
    responses in these rows (``prefix_shared``), or every prompt re-encoded with its response."""
    idx = torch.tensor(rows)
    batch = (module, tensors["input_ids"][idx], tensors["attention_mask"][idx], tensors["labels"][idx])
    return response_logprobs(*batch, prefix_shared=prefix_shared)


def _behaviour_logprobs(module, tensors: dict, micro_batches: list[list[int]],
                        prefix_shared: bool) -> tuple[torch.Tensor, int]:
    """Log-probs of the sampling policy, in the training pass's micro-batches (its memory, its
    shapes), and the prompt tokens sharing saved. Each rank scores its own micro-batches; the
    sum over ranks fills in every row (an empty micro-batch runs its stand-in and keeps nothing)."""
    old, saved = torch.zeros_like(tensors["mask"]), 0
    with torch.no_grad():
        for rows in micro_batches:
            out = _policy_logprobs(module, tensors, rows or [_STAND_IN], prefix_shared)
            if rows:
                old[torch.tensor(rows)] = out.logp
                saved += out.tokens_saved
    return sum_across_ranks(old), saved


def _minibatch_step(engine, cfg, tensors: dict, rows: list[int], micro_batches: list[list[int]],
                    old_logp: torch.Tensor, advantages: torch.Tensor, eps_high: float) -> dict:
    """One optimizer step on the minibatch ``rows``, its gradient accumulated over this rank's
    ``micro_batches`` (and summed over the ranks').

    A micro-batch's loss is the minibatch's loss with the other rows' log-probs held at their
    behaviour values (constants): the normalizers (each group's token count, the number of
    groups, responses or tokens) stay the minibatch's even where a slice cuts a group, so the
    micro gradients of all ranks sum to the minibatch's gradient (scaled by the rank count,
    which DeepSpeed's average over ranks divides out). Statistics are the minibatch's.
    """
    idx = torch.tensor(rows)
    position = {row: i for i, row in enumerate(rows)}
    mask, old, adv = tensors["mask"][idx], old_logp[idx], advantages[idx]

    def loss_of(logp: torch.Tensor):
        return policy_loss(cfg.loss, logp, old, adv, mask, cfg.eps_low, eps_high,
                           group_size=cfg.group_size, cispo_variant=cfg.cispo_variant,
                           normalization=cfg.normalization)

    logp_change, entropy_seen, norm, saved = torch.zeros_like(old), torch.zeros_like(old), None, 0
    own = max(1, sum(1 for micro in micro_batches if micro))
    for k, micro in enumerate(micro_batches):
        # an empty micro-batch still runs a forward and a backward (of a stand-in row, at weight zero)
        at = torch.tensor([position[r] for r in micro or [rows[0]]])
        logp, entropy, aux, tokens_saved, _ = _policy_logprobs(engine.module, tensors, micro or [rows[0]],
                                                               cfg.prefix_shared)
        loss, _ = loss_of(old.index_put((at,), logp))
        if k == len(micro_batches) - 1 and not engine.is_gradient_accumulation_boundary():
            raise RuntimeError(f"DeepSpeed's accumulation boundary is not at the end of this update "
                               f"(micro step {engine.micro_steps}, accumulation "
                               f"{engine.gradient_accumulation_steps()}): updates would mix minibatches")
        # the balance loss is per forward: its mean over this rank's own micro-batches (and the ranks)
        step_loss = loss * world_size() + aux / own
        norm = backward_and_step(engine, step_loss if micro else step_loss * 0.0, prescaled=True)
        if micro:
            saved += tokens_saved
            logp_change[at], entropy_seen[at] = logp.detach() - old[at], entropy.detach()
    logp_seen = old + sum_across_ranks(logp_change)
    loss, stats = loss_of(logp_seen)
    stats.update(loss=loss.item(), entropy=masked_mean(sum_across_ranks(entropy_seen), mask).item(),
                 grad_norm=norm if norm is not None else 0.0,
                 prefix_shared_tokens_saved=float(sum_across_ranks(torch.tensor(float(saved)))))
    return stats


def _update(h: StageHarness, engine, tensors: dict, advantages: torch.Tensor, eps_high: float,
            stale: bool = False) -> dict:
    """Behaviour log-probs, then ``updates_per_batch`` optimizer steps (each accumulated over
    the engine's ``gradient_accumulation_steps`` micro-batches), the whole plan run
    ``epochs_per_batch`` times; statistics averaged over the updates.

    The behaviour policy is the one that sampled: the trainer's own weights re-scored at
    training precision when they sampled (M1's fix for the train/inference mismatch), but the
    sampler's reported log-probs when the rollouts came from weights some updates behind
    (``stale``), whose log-probs the trainer no longer has the weights to compute.
    """
    cfg = h.stage_cfg
    accumulation = engine.gradient_accumulation_steps()
    plan = [(rows, _micro_batches(rows, accumulation))
            for rows in _minibatches(advantages.numel() // cfg.group_size, cfg.group_size, cfg.updates_per_batch)]
    old_logp, saved = _behaviour_logprobs(engine.module, tensors, [m for _, micro in plan for m in micro],
                                          cfg.prefix_shared)
    saved = float(sum_across_ranks(torch.tensor(float(saved))))
    # M1 traced RL failures to a training/inference log-prob gap (LM head precision): keep it
    # visible (with stale rollouts it also holds the drift of the updates since they were sampled)
    known = tensors.get("sampler_logp_known", tensors["mask"])
    gap = masked_mean((old_logp - tensors["sampler_logp"]).abs(), known).item()
    sums: dict[str, float] = {"train_infer_logprob_gap": gap, **split_accounting([rows for rows, _ in plan], accumulation)}
    if cfg.max_logprob_gap is not None:
        sums["logprob_gap_exceeded"] = float(gap > cfg.max_logprob_gap)
        if gap > cfg.max_logprob_gap:
            log.warning("train/inference log-prob gap %.4f exceeds rl.max_logprob_gap %.4f (sampler and trainer "
                        "disagree on the same tokens: precision, kernels or stale weights)", gap, cfg.max_logprob_gap)
    if stale:   # a token whose sampler log-prob is unknown keeps the trainer's, the nearest there is
        old_logp = torch.where(known > 0, tensors["sampler_logp"], old_logp) * tensors["mask"]
    elif cfg.tis_cap is not None:
        # the trainer's log-probs are the behaviour policy; TIS corrects for the sampler's differing
        weights, tis_stats = truncated_is_weights(old_logp, tensors["sampler_logp"], known * tensors["mask"],
                                                  cfg.tis_cap)
        advantages = advantages[:, None] * weights
        sums.update(tis_stats)
    passes = [(epoch, rows, micro) for epoch in range(cfg.epochs_per_batch) for rows, micro in plan]
    for epoch, rows, micro_batches in passes:
        stats = _minibatch_step(engine, cfg, tensors, rows, micro_batches, old_logp, advantages, eps_high)
        saved += stats.pop("prefix_shared_tokens_saved")
        if epoch == cfg.epochs_per_batch - 1 and cfg.epochs_per_batch > 1:
            # the last pass over the batch: how far its tokens moved off their sampling policy
            sums["last_epoch_clip_fraction"] = sums.get("last_epoch_clip_fraction", 0.0) + stats["clip_fraction"] / len(plan)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v / len(passes)
    # tokens the step's forwards (behaviour pass and every update) did not re-encode, and their
    # share of what re-encoding would have run
    # every row: once for the behaviour log-probs, once in its update of every pass
    encoded = (1 + cfg.epochs_per_batch) * float(tensors["attention_mask"].sum())
    sums.update(prefix_shared_tokens_saved=float(saved), prefix_shared_saved_fraction=saved / max(encoded, 1.0))
    return sums


def sampling_model(job, policy_version: int) -> str:
    """The weights that sampled a rollout, named as the ``models`` table names this stage's model
    (``model_id``, ``<run>/<stage>``) at the optimizer update that made them:
    ``<run>/<stage>@update<N>``, N the rollout's ``policy_version`` (``@update0``: the stage's
    initial model, ``models.init_model`` of that model_id)."""
    return f"{job.run_name}/{job.stage}@update{int(policy_version)}"


def _rollout_rows(h: StageHarness, step: int, seen: list, sampler) -> list[dict]:
    cfg = h.stage_cfg
    out = []
    for row, completions, scored, round_ in seen:
        for i, (c, sample) in enumerate(zip(completions, scored)):
            logprob_sum, logprob_mean = c.logprob_summary()
            out.append({
                "rollout_id": f"rl:{h.job.run_name}:{step}:{round_}:{row['prompt_id']}:{i}",
                "prompt_id": row["prompt_id"], "source_table": "rl_prompts", "domain": row["domain"],
                "sample_index": i, "text": c.text, "token_ids": list(c.token_ids), "num_tokens": len(c.token_ids),
                "logprob_sum": logprob_sum, "logprob_mean": logprob_mean,
                "finish_reason": c.finish_reason, "truncated": c.truncated, "reward": float(sample.reward),
                "backend": sampler.name, "model": sampling_model(h.job, c.policy_version),
                "temperature": cfg.temperature, "top_p": cfg.top_p,
                "seed": h.cfg.seed, "run_id": h.job.mlflow_run_id, "train_run": h.job.run_name, "step": step,
                "policy_version": c.policy_version, "staleness": sampler.trainer_version - c.policy_version,
                "policy_version_last": c.last_version, "version_boundary": c.version_boundary})
    return out


def _stored_rollout_ids(h: StageHarness, start: int) -> set[str]:
    """Rollouts of this run from step ``start`` on already in ``rl_rollouts``: a run killed after
    storing a checkpoint's rollouts but before that checkpoint was saved resumes from the one
    before and samples those steps again (the same rollouts, same ids); they are not stored twice."""
    if start == 0 or not h.is_rank0:
        return set()
    wh = Warehouse(h.job.home)
    if not wh.exists("rl_rollouts"):
        return set()
    stored = wh.scan("rl_rollouts").filter((pl.col("train_run") == h.job.run_name) & (pl.col("step") >= start))
    return set(stored.select("rollout_id").collect()["rollout_id"].to_list())


def _store_rollouts(h: StageHarness, rows: list[dict], reward: DomainReward, stored: set[str] = frozenset()) -> None:
    """Append the pending rollouts (to the stage's own ``rl_rollouts``; those in ``stored``
    already are) and the judge outputs that scored them (then forget both)."""
    if h.is_rank0:
        wh = Warehouse(h.job.home)
        rows = [r for r in rows if r["rollout_id"] not in stored]
        if rows:
            wh.append("rl_rollouts", pl.DataFrame(rows), parents=[h.job.data_ref])
        if reward.judgments:
            wh.append("judgments", get_spec("judgments").conform(pl.DataFrame(reward.judgments)),
                      parents=[h.job.data_ref])
    reward.judgments.clear()


def load_pool(h: StageHarness) -> list[dict]:
    pool = []
    for r in h.read_data().iter_rows(named=True):
        pool.append({**r, "source_row": {**r, "id": r["prompt_id"]}})   # what verify(domain, row, ...) reads
    return pool


def judge_backend_factory(rollout: RolloutConfig, home: str) -> JudgeFactory:
    """Builds the judge's rollout backend on first use ("policy" and the tiny alias resolve under the job's home)."""
    def build() -> RolloutBackend:
        from tasks.genrm.models import resolve_rollout
        from tasks.rollout.factory import make_backend

        return make_backend(resolve_rollout(rollout, home))
    return build


def make_rewarder(h: StageHarness, pool: list[dict], reward_fn: RewardFn | None,
                  judge_backend: JudgeFactory | None) -> DomainReward:
    """The step's reward: ``reward_fn`` for every sample when given, else verifiers + GenRM by domain.

    References, the judge's length calibration and the judge's checkpoint (``extra["judge_model"]``)
    come from what the stage was handed (``handed_ref``), not from whatever is newest while it trains."""
    cfg = h.stage_cfg.genrm
    judge_rollout = cfg.judge.rollout
    if (h.job.extra or {}).get("judge_model"):   # the judge's checkpoint the train flow was handed
        judge_rollout = judge_rollout.model_copy(update={"model": h.job.extra["judge_model"]})
    references: dict[str, str] = {}
    if cfg.enabled and reward_fn is None and any(r["domain"] in cfg.domains for r in pool):
        ref = handed_ref(h, "references")
        if ref is not None:
            references = references_by_prompt(current_references(Warehouse(h.job.home), ref.snapshot),
                                              {r["prompt_id"] for r in pool})
    rewarder = DomainReward(cfg, references, judge_backend or judge_backend_factory(judge_rollout, h.job.home),
                            seed=h.cfg.seed, custom=reward_fn, run_id=h.job.mlflow_run_id,
                            rollout_prefix=f"rl:{h.job.run_name}", home=h.job.home,
                            verify_workers=h.stage_cfg.verify_workers, format=h.stage_cfg.format_reward)
    rewarder.pin_calibrations(handed_ref(h, "judge_calibrations"))
    return rewarder


def job_reward_fn(h: StageHarness) -> RewardFn | None:
    """The custom reward the job names in ``extra["reward_fn"]`` ("package.module:function", or
    "path/to/file.py:function"), so a stage its launcher starts in other processes can take one
    as ``train_rl``'s caller can (ablations, tests); None when it names none."""
    spec = (h.job.extra or {}).get("reward_fn")
    if not spec:
        return None
    where, _, name = str(spec).rpartition(":")
    if where.endswith(".py"):
        loader = importlib.util.spec_from_file_location(f"posttrain_reward_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def train_rl(h: StageHarness, reward_fn: RewardFn | None = None, judge_backend: JudgeFactory | None = None) -> dict:
    """Train the RL stage; ``reward_fn`` (else the job's, ``job_reward_fn``) replaces the domain
    rewards, ``judge_backend`` the configured judge."""
    cfg = h.stage_cfg
    model, tokenizer = h.load_policy()
    pool = load_pool(h)
    rewarder = make_rewarder(h, pool, reward_fn or job_reward_fn(h), judge_backend)
    curriculum = Curriculum(cfg.curriculum, [r["domain"] for r in pool], h.cfg.seed,
                            tasks=[r.get("task") for r in pool], levels=[r.get("level") for r in pool],
                            level_windows=cfg.level_windows)
    for line in curriculum.unused(cfg.steps):
        log.warning("rl.curriculum: %s", line)
    schedule = LengthSchedule(cfg.windows, cfg.gates)
    engine = h.create_engine(model, gradient_clipping=schedule.window.gradient_clipping)
    start, state = h.resume(engine)
    if state.get("length_schedule"):
        schedule.load_state_dict(state["length_schedule"])
        set_gradient_clipping(engine, schedule.window.gradient_clipping)
    # events reach the flow through the stage summary (tasks cannot start flows): no callback
    monitor = LengthBiasMonitor(cfg.length_bias, run_id=h.job.mlflow_run_id if h.is_rank0 else None)
    if state.get("length_bias"):
        monitor.load_state_dict(state["length_bias"])  # the statistic's window survives a resume
        if state.get("length_correction"):   # and so does a correction the stage put in force
            rewarder.use_correction(LengthCorrection.from_mapping(state["length_correction"]))
    else:
        monitor.step = start  # its step numbers follow the RL steps (1-based)
    # in process: the sampler shares the engine's module, so it samples from the updated weights
    # after every optimizer step; served: a rollout engine process gets the weights pushed
    sampler = make_sampler(h, engine, tokenizer)
    sampler.load_state_dict(state.get("rollouts_ahead"))   # a resumed stage: the batches its checkpoint waited for
    try:
        refresh = WindowRefresh(cfg.window_refresh, pool, curriculum) if cfg.window_refresh.enabled else None
        if refresh is not None:
            refresh.load_state_dict(state.get("window_refresh"))
        adaptive = AdaptiveLevels(cfg.adaptive_levels, pool, curriculum) if cfg.adaptive_levels.enabled else None
        if adaptive is not None:
            adaptive.load_state_dict(state.get("adaptive_levels"))
        return _train_loop(h, engine, tokenizer, sampler, pool, rewarder, curriculum, schedule, monitor, start,
                           refresh, adaptive)
    finally:
        sampler.close()


def _train_loop(h: StageHarness, engine, tokenizer, sampler, pool, rewarder, curriculum, schedule, monitor,
                start: int, refresh: WindowRefresh | None = None, adaptive: AdaptiveLevels | None = None) -> dict:
    cfg = h.stage_cfg
    events: list[dict] = []
    pad, prompt_cache, pending, last = pad_id_of(tokenizer), {}, [], {}
    stored = _stored_rollout_ids(h, start)
    for step in range(start, cfg.steps):
        step_started = time.monotonic()
        window = schedule.window
        sampler.prepare()   # the engine gets the weights this step's sampling (and the batches ahead) begin with
        # rank 0 samples and scores; every rank trains on its share of the same kept groups
        if h.is_rank0:
            sampled = _sample_groups(h, sampler, pool, curriculum, step, window.max_tokens, rewarder, tokenizer)
            _sample_ahead(h, sampler, pool, curriculum, step, window.max_tokens, rewarder, tokenizer)
        kept, stats, seen = broadcast_from_rank0(sampled if h.is_rank0 else None)
        pending.extend(_rollout_rows(h, step, seen, sampler))
        lag = _staleness(kept, sampler.trainer_version)
        metrics = {**stats, **lag, "window": float(window.max_tokens), "eps_high": window.eps_high,
                   "engine_syncs": float(sampler.syncs), "engine_sync_seconds": sampler.sync_seconds,
                   **sampler.metrics(), "gradient_clipping": window.gradient_clipping,
                   "curriculum_phase": float(curriculum.phase_index(step)), "lr": current_lr(engine)}
        if kept.num_groups:
            update_started = time.monotonic()
            tensors = _training_tensors(kept, tokenizer, prompt_cache, pad)
            advantages = group_advantages(torch.tensor(kept.rewards), cfg.group_size)
            metrics.update(_update(h, engine, tensors, advantages, window.eps_high,
                                   stale=lag["policy_staleness"] > 0))
            metrics["update_seconds"] = time.monotonic() - update_started
        reading = schedule.observe(stats["generation_perplexity"], stats["response_length_p99"])
        metrics.update(gate_perplexity_converged=float(reading.perplexity_converged),
                       gate_length_near_window=float(reading.length_near_window))
        if refresh is not None:
            refresh.observe(seen)
        if adaptive is not None:
            adaptive.observe(seen)
            if adaptive.due(step):   # the levels the next steps draw
                metrics.update(adaptive.measure(step))
        if reading.advanced:
            set_gradient_clipping(engine, schedule.window.gradient_clipping)
            if refresh is not None:   # the next window draws from the refreshed pool
                metrics.update(refresh.advance())
                log.info("rl step %d: window %d; refresh dropped %d solved prompts, %d left", step,
                         schedule.window.max_tokens, metrics["refresh_dropped"], metrics["refresh_pool"])
        event = monitor.update(*_monitor_inputs(seen))
        if monitor.history[-1][1] is not None:
            metrics["length_bias_statistic"] = monitor.history[-1][1]
        if event is not None:
            record = {**event.as_dict(), "rl_step": step, **rewarder.event_context()}
            if cfg.length_bias.trigger_recalibration and rewarder.custom is None:
                # in force from the next step; the train flow stores and checks it after the stage
                correction = rewarder.recalibrate(record)
                record["applied_from_step"] = step + 1
                metrics["length_correction_slope_applied"] = correction.slope
                log.warning("rl step %d: length-bias event; GenRM rewards corrected from step %d on "
                            "(slope %.4f)", step, step + 1, correction.slope)
            events.append(record)
        metrics["step_seconds"] = time.monotonic() - step_started
        h.record(step, metrics)
        last = metrics
        if h.checkpoint_due(step):
            _store_rollouts(h, pending, rewarder, stored)
            pending = []
            sampler.prepare()   # the batches in flight may continue under these weights (partial rollouts)
            h.maybe_checkpoint(engine, step, {"length_schedule": schedule.state_dict(),
                                              "length_bias": monitor.state_dict(),
                                              "length_correction": rewarder.in_stage_correction(),
                                              "rollouts_ahead": sampler.state_dict(),
                                              "window_refresh": refresh.state_dict() if refresh else None,
                                              "adaptive_levels": adaptive.state_dict() if adaptive else None})
    _store_rollouts(h, pending, rewarder, stored)
    return h.finish(engine, tokenizer, {"final_loss": last.get("loss"), "final_reward_mean": last.get("reward_mean"),
                                        "final_window": schedule.window.max_tokens, "prompts": len(pool),
                                        "length_bias_events": events,
                                        # phase settings that did nothing here (also logged at the start)
                                        "curriculum_unused": curriculum.unused(cfg.steps)},
                    curves=("loss", "reward_mean", "response_length_p99", "generation_perplexity", "window"))
