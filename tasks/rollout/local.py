"""Local rollout backend: our own batched sampler over any causal LM, on CPU or GPU.

Why not ``model.generate``: rollouts need per-token log-probs of the sampled tokens, the M1
repetition rule applied while generating, and a batch that shrinks as sequences finish
(the KV cache is compacted, so finished rows stop costing compute). The loop is:
left-padded prefill over the batch, then one token per step reusing ``past_key_values``.
"""
from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model.loading import load_causal_lm
from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.chat import render_with_tokenizer
from tasks.rollout.config import LocalConfig
from tasks.rollout.repetition import RepetitionTracker


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids, their log-probs).

    The log-prob is taken under the temperature-scaled distribution before top-p
    renormalization, i.e. the behaviour policy an RL importance ratio compares against.
    Temperature 0 means greedy decoding, and the log-prob is then the model's own.
    ``uniforms``: one U[0, 1) draw per row (each row's own stream), turned into its token by the
    inverse of the row's CDF; else ``generator`` draws for the whole batch.
    """
    logits = logits.float()
    if temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        if uniforms is not None:
            tokens = _inverse_cdf(logprobs.exp(), uniforms)
        else:
            tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_probs, top_ids = _nucleus_candidates(logprobs, top_p)
    # Drop a token once the mass strictly before it already reaches top_p; the most
    # likely token is always kept.
    mass_before = top_probs.cumsum(dim=-1) - top_probs
    top_probs = top_probs.masked_fill(mass_before >= top_p, 0.0)
    if uniforms is not None:
        picked = _inverse_cdf(top_probs, uniforms)[:, None]
    else:
        picked = torch.multinomial(top_probs, 1, generator=generator)
    tokens = top_ids.gather(-1, picked).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds ``u`` times the row's total (a
    zero-weight index is never picked)."""
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return picked.clamp(max=weights.shape[-1] - 1)


def sequence_seed(seed: int, prompt_ids: list[int], index: int) -> int:
    """The seed of one sequence's random stream: the call's seed, the prompt's ids, the sample's
    index among the prompt's ``n``."""
    h = hashlib.blake2b(f"{seed}|{index}|".encode() + torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes(),
                        digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


_NUCLEUS_FIRST_K = 1024


def _nucleus_candidates(logprobs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens of each row, descending, enough of them to cover ``top_p``.

    A full-vocabulary sort every step is costly (a fifth of SmolLM2-135M's decode time on
    one CPU thread) while the nucleus is usually a few hundred tokens, so take a bounded top-k and widen it
    only while some row's top-k mass is still below ``top_p``. Every token the nucleus rule
    keeps is then inside the candidates, so the result equals sorting the whole vocabulary.
    """
    vocab = logprobs.shape[-1]
    k = min(_NUCLEUS_FIRST_K, vocab)
    while True:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        top_probs = top_logprobs.exp()
        if k == vocab or bool((top_probs.sum(dim=-1) >= top_p).all()):
            return top_probs, top_ids
        k = min(k * 4, vocab)


def _shared_prefix_length(prompt_ids: list[list[int]]) -> int:
    """Tokens all prompts start with, leaving each at least one token of its own."""
    if len(prompt_ids) < 2:
        return 0
    limit = min(len(ids) for ids in prompt_ids) - 1
    first = prompt_ids[0]
    length = 0
    while length < limit and all(ids[length] == first[length] for ids in prompt_ids):
        length += 1
    return length


def _is_plain_kv_cache(past) -> bool:
    """A transformers KV cache with only growing key/value layers: a padded hole is harmless."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(past, "layers", None)
    return isinstance(past, DynamicCache) and bool(layers) and all(
        type(layer) is DynamicLayer for layer in layers
    )


@dataclass
class _Sequence:
    prompt_index: int
    prompt_ids: list[int]
    sample_index: int = 0


@dataclass(frozen=True)
class WeightSwitch:
    """New weights mid-generation (a partial rollout): ``apply()`` runs once, before the forward
    whose logits sample token ``at`` of every sequence, so tokens ``[0, at)`` come from the weights
    in force when generation began and the rest from the new ones. The KV cache of the earlier
    tokens is kept (as PipelineRL's in-flight weight updates do), not recomputed."""
    at: int
    apply: Callable[[], None]


class LocalBackend:
    """Batched sampling with a KV cache for a local causal LM (HF dir, GGUF, in-house)."""

    name = "local"

    def __init__(self, model, tokenizer, config: LocalConfig | None = None, model_name: str | None = None):
        self.config = config or LocalConfig()
        # what rollouts and difficulty rows record as their model: the path it was loaded from
        self.model_name = model_name or getattr(getattr(model, "config", None), "_name_or_path", None) or self.name
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.pad_id = self._pad_token_id()
        self.eos_ids = self._eos_token_ids()
        forward_args = inspect.signature(model.forward).parameters
        self._accepts_position_ids = "position_ids" in forward_args
        self._accepts_logits_to_keep = "logits_to_keep" in forward_args
        # transformers 5.x renamed past_key_values to cache; older models keep the old name.
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Learned from the first prefill: can the cache copy rows / extend a shared prefix?
        self._cache_selectable: bool | None = None
        self._prefix_cache_ok: bool | None = None

    @classmethod
    def from_path(cls, path: str | Path, config: LocalConfig | None = None) -> LocalBackend:
        config = config or LocalConfig()
        model, tokenizer = load_causal_lm(path, dtype=config.dtype, device=config.device)
        return cls(model, tokenizer, config, model_name=str(path))

    # -- RolloutBackend -------------------------------------------------------------------
    def format_chat(self, messages: list[dict[str, str]]) -> str:
        return render_with_tokenizer(self.tokenizer, messages)

    def generate(self, prompts: list[str], params: SamplingParams,
                 switch: WeightSwitch | None = None) -> list[list[Completion]]:
        """``params.n`` completions per prompt; with ``switch``, every sequence is sampled in one
        batch (a second batch would begin under the switched weights)."""
        return self.generate_ids(self._encode_prompts(prompts), params, switch)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     switch: WeightSwitch | None = None) -> list[list[Completion]]:
        """``generate`` from prompts given as token ids: multi-turn rollouts extend the ids they
        sampled instead of re-encoding a rendered history (token exactness)."""
        sequences = [
            _Sequence(i, list(ids), j)
            for i, ids in enumerate(prompt_ids)
            for j in range(params.n)
        ]
        # Similar lengths share a batch so left padding wastes little compute.
        order = sorted(range(len(sequences)), key=lambda s: -len(sequences[s].prompt_ids))
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        results: list[Completion | None] = [None] * len(sequences)
        batch_size = self.config.batch_size if switch is None else max(1, len(order))
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            streams = ([torch.Generator(device="cpu").manual_seed(
                sequence_seed(params.seed, sequences[s].prompt_ids, sequences[s].sample_index)) for s in batch]
                if params.seed_per_sequence else None)
            completions = self._sample_batch([sequences[s].prompt_ids for s in batch], params, generator, switch,
                                             streams)
            for s, completion in zip(batch, completions):
                results[s] = completion
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for sequence, completion in zip(sequences, results):
            grouped[sequence.prompt_index].append(completion)
        return grouped

    # -- internals ------------------------------------------------------------------------
    def _pad_token_id(self) -> int:
        tok = self.tokenizer
        for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(e) for e in gen_eos)
        return ids

    def _encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        bos = self.tokenizer.bos_token
        encoded = []
        for prompt in prompts:
            # Chat templates already start with BOS; adding it again shifts the model.
            add_special = not (bos and prompt.startswith(bos))
            ids = self.tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
            if not ids:
                ids = [self.pad_id if self.tokenizer.bos_token_id is None else self.tokenizer.bos_token_id]
            encoded.append(list(ids))
        return encoded

    def _forward(self, input_ids, attention_mask, position_ids, past, prefill: bool):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True}
        if past is not None:
            kwargs[self._cache_arg] = past
        if self._accepts_position_ids:
            kwargs["position_ids"] = position_ids
        if prefill and self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # the prompt's other logits are never used
        out = self.model(**kwargs)
        cache = getattr(out, "cache", None)
        return out.logits[:, -1, :], cache if cache is not None else out.past_key_values

    def _prefill(self, prompt_ids: list[list[int]]):
        """Run the prompts through the model once: (last logits, cache, mask, next position).

        Cache reuse: the n samples of a prompt share one prefill (its cache rows are copied
        afterwards), and when the distinct prompts share a prefix (the chat template's system
        turn) that prefix is run once and its cache copied to every prompt.
        """
        distinct: dict[tuple[int, ...], int] = {}
        slot_of_row = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
        prompts = [list(ids) for ids in distinct]
        if self._cache_selectable is False:  # rows cannot be copied: prefill every copy
            prompts, slot_of_row = [list(ids) for ids in prompt_ids], list(range(len(prompt_ids)))
        state = None
        shared = _shared_prefix_length(prompts)
        if shared and self._prefix_cache_ok is not False:
            state = self._prefill_after_shared_prefix(prompts, shared)
        if state is None:
            state = self._prefill_padded(prompts)
        logits, past, attention_mask, next_position = state
        self._cache_selectable = hasattr(past, "batch_select_indices")
        if len(prompts) < len(prompt_ids):
            if not self._cache_selectable:
                return self._prefill_padded(prompt_ids)
            rows = torch.tensor(slot_of_row, device=self.device)
            past.batch_select_indices(rows)
            logits, attention_mask, next_position = logits[rows], attention_mask[rows], next_position[rows]
        return logits, past, attention_mask, next_position

    def _prefill_padded(self, prompt_ids: list[list[int]], past=None, cached_length: int = 0):
        """Left-padded forward of the prompts, optionally after ``cached_length`` cached tokens."""
        device, batch = self.device, len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((batch, cached_length + width), dtype=torch.long, device=device)
        attention_mask[:, :cached_length] = 1
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, cached_length + width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, cached_length:]
        logits, past = self._forward(input_ids, attention_mask, position_ids, past, prefill=True)
        return logits, past, attention_mask, position_ids[:, -1:] + 1

    def _prefill_after_shared_prefix(self, prompt_ids: list[list[int]], shared: int):
        """Prefill ``shared`` common tokens once, then the rest of every prompt on top of it.

        The padding then sits between the prefix and each prompt's rest, which only a plain
        KV cache tolerates (a recurrent state would absorb the pad tokens); for any other
        cache this returns None once and the caller prefills the usual way from then on.
        """
        prefix = torch.tensor([prompt_ids[0][:shared]], dtype=torch.long, device=self.device)
        positions = torch.arange(shared, device=self.device)[None]
        _, past = self._forward(prefix, torch.ones_like(prefix), positions, None, prefill=True)
        self._prefix_cache_ok = _is_plain_kv_cache(past)
        if not self._prefix_cache_ok:
            return None
        past.batch_select_indices(torch.zeros(len(prompt_ids), dtype=torch.long, device=self.device))
        return self._prefill_padded([ids[shared:] for ids in prompt_ids], past, cached_length=shared)

    @torch.inference_mode()
    def _sample_batch(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator,
        switch: WeightSwitch | None = None, streams: list[torch.Generator] | None = None,
    ) -> list[Completion]:
        """``streams``: each row's own random stream (``SamplingParams.seed_per_sequence``)."""
        device, batch = self.device, len(prompt_ids)
        logits, past, attention_mask, next_position = self._prefill(prompt_ids)

        max_new = params.max_tokens
        out_tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((batch, max_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finish = ["length"] * batch
        alive = torch.arange(batch, device=device)  # original row of each live batch slot
        tracker = RepetitionTracker(batch, params.repetition_window, params.repetition_prob, device)
        eos = torch.tensor(sorted(self.eos_ids) or [-1], device=device)
        stop_tail = max((len(s) for s in params.stop), default=0) + 8

        # Caches that cannot drop rows keep finished rows in the batch, masked out here.
        can_compact = hasattr(past, "batch_select_indices")
        active = torch.ones(batch, dtype=torch.bool, device=device)
        for step in range(max_new):
            uniforms = None
            if streams is not None and params.temperature != 0:
                # every slot of the batch draws from its own row's stream (a finished row kept in
                # a cache that cannot drop rows draws too, and its token is ignored)
                uniforms = torch.cat([torch.rand(1, generator=streams[row]) for row in alive.tolist()]).to(device)
            tokens, logprobs = sample_next_token(logits, params.temperature, params.top_p, generator, uniforms)
            rows = alive[active]
            out_tokens[rows, step] = tokens[active]
            out_logprobs[rows, step] = logprobs[active]
            lengths[rows] = step + 1

            done = self._finished_slots(tokens, logprobs, eos, tracker, alive, active, finish)
            if params.stop:
                self._mark_stop_strings(done, active, alive, out_tokens, step, stop_tail, params, finish)
            active &= ~done
            if step + 1 == max_new or not bool(active.any()):
                break
            if can_compact and bool(done.any()):
                keep = active.nonzero().flatten()
                alive, tokens, next_position = alive[keep], tokens[keep], next_position[keep]
                attention_mask, active = attention_mask[keep], active[keep]
                tracker.select(keep)
                past.batch_select_indices(keep)
            attention_mask = torch.cat(
                [attention_mask, active[:, None].long()], dim=1
            )
            if switch is not None and step + 1 == switch.at:
                switch.apply()   # the next forward samples token ``at``: under the new weights
            logits, past = self._forward(tokens[:, None], attention_mask, next_position, past, prefill=False)
            next_position = next_position + 1

        return [
            self._completion(out_tokens[row, : lengths[row]].tolist(),
                             out_logprobs[row, : lengths[row]].tolist(), finish[row], params)
            for row in range(batch)
        ]

    def _finished_slots(self, tokens, logprobs, eos, tracker, alive, active, finish) -> torch.Tensor:
        """EOS or M1 repetition, per batch slot; records the finish reason of each."""
        done = torch.isin(tokens, eos) & active
        repeated = tracker.update(logprobs) & active & ~done
        for slot in repeated.nonzero().flatten().tolist():
            finish[alive[slot].item()] = "repetition"
        for slot in done.nonzero().flatten().tolist():
            finish[alive[slot].item()] = "stop"
        return done | repeated

    def _mark_stop_strings(self, done, active, alive, out_tokens, step, stop_tail, params, finish) -> None:
        """A stop string may span tokens, so the tail of each live sequence is decoded."""
        for slot in (active & ~done).nonzero().flatten().tolist():
            row = alive[slot].item()
            tail_ids = out_tokens[row, max(0, step + 1 - stop_tail) : step + 1].tolist()
            tail = self.tokenizer.decode(tail_ids, skip_special_tokens=True)
            if any(s in tail for s in params.stop):
                done[slot] = True
                finish[row] = "stop"

    def _completion(
        self, token_ids: list[int], logprobs: list[float], finish_reason: str, params: SamplingParams
    ) -> Completion:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if params.stop:
            # OpenAI convention: the text ends before the stop string; token ids keep it.
            cuts = [text.find(s) for s in params.stop if s in text]
            if cuts:
                text = text[: min(cuts)]
                finish_reason = "stop" if finish_reason != "repetition" else finish_reason
        return Completion(
            text=text,
            token_ids=token_ids,
            logprobs=logprobs if params.logprobs else None,
            finish_reason=finish_reason,
        )
