"""Hybrid lightning-attention causal LM (MiniMax-01 style), readable top to bottom.

Layer stack: lightning attention (linear attention with per-head exponential decay) in most
layers, softmax attention with GQA and partial RoPE every ``softmax_attention_every``-th
layer; each followed by a dense SwiGLU or top-k MoE feed-forward. Pre-norm residuals.
The LM head runs in FP32 (BF16 log-probs of rare tokens broke RL in MiniMax-M1), and
``fused_token_logprobs`` scores labels through the fused kernel without full-vocabulary logits.

Decoding keeps one constant-size [B, H, K, V] fp32 state per lightning layer
(``HybridCache``) and a growing KV cache only for the softmax layers.

The softmax layers never build a T x T mask (see ``softmax_attention``): causal SDPA (flash on
a GPU) when nothing is padded or the batch is right-padded, causal aligned at the end when
a cache precedes the queries, each row on its own real tokens otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from kernels import head_logprobs, lightning_attn, lightning_attn_recurrent

from .config import IGNORE_INDEX, LINEAR, HybridConfig, build_model_config

# --------------------------------------------------------------------------- cache


class LightningStateLayer(LinearAttentionLayer):
    """Cache entry of one lightning layer: only its fp32 key-value state, never grows."""

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
        # assigned, not copied: the state's shape is fixed per generate call and this keeps
        # batch_select / repeat below free of a preallocated buffer
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = True
        self.has_previous_state[state_idx] = True
        self.device, self.dtype = recurrent_states.device, recurrent_states.dtype
        return recurrent_states

    def batch_repeat_interleave(self, repeats: int) -> None:
        for i, state in self.recurrent_states.items():
            if state is not None:
                self.recurrent_states[i] = state.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for i, state in self.recurrent_states.items():
            if state is not None:
                self.recurrent_states[i] = state[indices]


class HybridCache(Cache):
    """Recurrent states for lightning layers, a dynamic KV cache for softmax layers."""

    def __init__(self, config: HybridConfig):
        layers = [
            LightningStateLayer() if kind == LINEAR else DynamicLayer() for kind in config.layer_types
        ]
        super().__init__(layers=layers)
        self.seen_tokens = 0
        # per MoE layer, per row: routing sums of the cached tokens (see accumulate_router_sums)
        self.router_sums: dict[int, tuple[torch.Tensor, ...]] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # tracked here because a cache of only lightning layers has no KV length to read
        return self.seen_tokens

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens

    def accumulate_router_sums(self, layer_idx: int, sums: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Add one forward's per-row routing sums to the cached tokens' and keep the total, so
        that a forward on top of a cache gets the balance loss of the whole sequence (a prompt
        encoded once and shared by G responses then weighs G times, as in G full forwards)."""
        past = self.router_sums.get(layer_idx)
        if past is not None:
            sums = tuple(p + s for p, s in zip(past, sums))
        self.router_sums[layer_idx] = sums
        return sums

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.router_sums = {i: tuple(t[indices] for t in sums) for i, sums in self.router_sums.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.router_sums = {i: tuple(t[beam_idx] for t in sums) for i, sums in self.router_sums.items()}

    def reset(self) -> None:
        super().reset()
        self.router_sums = {}

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.router_sums = {i: tuple(t.repeat_interleave(repeats, dim=0) for t in sums)
                            for i, sums in self.router_sums.items()}

    def state_bytes(self) -> dict[str, int]:
        """Memory held by lightning states vs softmax KV tensors (for the constant-size check)."""
        linear = sum(
            s.numel() * s.element_size()
            for layer in self.layers
            if isinstance(layer, LightningStateLayer)
            for s in layer.recurrent_states.values()
            if s is not None
        )
        softmax = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if isinstance(layer, DynamicLayer) and layer.is_initialized
            for t in (layer.keys, layer.values)
        )
        return {"lightning": linear, "softmax_kv": softmax}


# --------------------------------------------------------------------------- blocks


class HybridRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> list[float]:
    """MiniMax-01 decay rates: s_h = 2^(-8h/H), h = 1..H, shrunk in deeper layers so they
    remember longer; the last layer's factor is ~1e-5 (almost no decay)."""
    layer_factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return [2 ** (-8 * h / num_heads) * layer_factor for h in range(1, num_heads + 1)]


class LightningAttention(nn.Module):
    """SiLU(q, k, v), decayed linear attention, RMSNorm over all heads, sigmoid output gate."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.chunk_size = config.lightning_chunk_size
        inner = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(config.hidden_size, inner, bias=False)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.norm = HybridRMSNorm(inner, eps=config.rms_norm_eps)
        # a plain attribute, not a buffer: nothing to save, nothing to re-init after meta loading
        self.slopes = lightning_slopes(self.num_heads, layer_idx, config.num_hidden_layers)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None, cache: HybridCache | None):
        batch, seq_len, _ = x.shape
        qkv = F.silu(self.qkv_proj(x))
        if token_mask is not None:
            # padded positions write nothing into the state (left padding in batched decoding)
            qkv = qkv * token_mask[:, -seq_len:, None].to(qkv.dtype)
        qkv = qkv.view(batch, seq_len, self.num_heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        slope = torch.tensor(self.slopes, device=x.device, dtype=torch.float32)

        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        if state is not None and seq_len == 1:
            out, new_state = lightning_attn_recurrent(q, k, v, slope, state, output_final_state=True)
        else:
            out, new_state = lightning_attn(
                q.contiguous(), k.contiguous(), v.contiguous(), slope,
                initial_state=state, output_final_state=cache is not None, chunk_size=self.chunk_size,
            )
        if cache is not None:
            cache.update_recurrent_state(new_state, self.layer_idx)

        out = out.transpose(1, 2).reshape(batch, seq_len, -1)
        out = self.norm(out) * torch.sigmoid(self.output_gate(x))
        return self.out_proj(out)


def rotary_cos_sin(position_ids: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=position_ids.device).float() / rotary_dim))
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, rot/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, rot]


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


@dataclass(frozen=True)
class SoftmaxPadding:
    """What the softmax layers of one forward need to know about its padding, decided once.

    ``key_mask`` [B, past+T] marks real tokens (None when all are); ``plain_causal`` says that
    causal attention over the whole batch is already exact for every real query: nothing is
    padded, or the batch is right-padded with nothing cached (real queries never reach a pad).
    """

    key_mask: torch.Tensor | None
    plain_causal: bool

    @classmethod
    def of(cls, token_mask: torch.Tensor | None, past: int, seq_len: int) -> SoftmaxPadding:
        if token_mask is None:
            return cls(None, True)
        keys = token_mask[:, -(past + seq_len):]
        if bool(keys.all()):
            return cls(None, True)
        no_real_after_pad = bool((keys[:, :-1] | ~keys[:, 1:]).all())
        return cls(keys, past == 0 and no_real_after_pad)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with the queries as the last keys (cached keys come first), maskless."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q_len == 1:
        return F.scaled_dot_product_attention(q, k, v)
    # lower-right alignment; dispatched to flash on a GPU, materialized only on the CPU path
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, kv_len))


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: SoftmaxPadding) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, H, past+T, D], causal, padded keys unseen; no T x T mask.

    - nothing padded, or right padding without a cache: one causal call for the batch;
    - one query per row (decoding) with padding: a [B, 1, 1, past+1] key mask, linear in T;
    - otherwise (left padding, a padded prefix in the cache): each row on its real tokens only,
      packed, causal aligned at the end. Padded query positions come out 0: nothing reads them
      (their lightning inputs are masked, their labels ignored).
    """
    if padding.key_mask is None or padding.plain_causal:
        return causal_attention(q, k, v)
    if q.shape[2] == 1:
        visible = padding.key_mask.clone()
        visible[:, -1] = True  # the query itself, so a padded one never softmaxes over nothing
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :])
    rows = []
    for row, real in enumerate(padding.key_mask):
        keys = real.nonzero().squeeze(1)
        queries = real[-q.shape[2]:].nonzero().squeeze(1)
        out = q.new_zeros(1, q.shape[1], q.shape[2], v.shape[3])
        if queries.numel():
            attended = causal_attention(q[row : row + 1, :, queries], k[row : row + 1, :, keys],
                                        v[row : row + 1, :, keys])
            out = out.index_copy(2, queries, attended)
        rows.append(out)
    return torch.cat(rows)


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with grouped KV heads and RoPE on part of each head."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, rotary, padding: SoftmaxPadding, cache: HybridCache | None):
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = softmax_attention(q, k, v, padding)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with the Switch-Transformer load-balancing loss."""

    def __init__(self, config: HybridConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.intermediate_size) for _ in range(self.num_experts)
        )

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None, cache: HybridCache | None = None):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        top_p, top_idx = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert_id, expert in enumerate(self.experts):
            token_idx, slot = torch.where(top_idx == expert_id)
            if token_idx.numel():
                weight = top_p[token_idx, slot, None].to(flat.dtype)
                out.index_add_(0, token_idx, expert(flat[token_idx]) * weight)
        return out.view_as(x), self._balance_loss(probs, top_idx, token_mask, x.shape[:2], cache)

    def _balance_loss(self, probs, top_idx, token_mask, batch_seq, cache) -> torch.Tensor:
        """num_experts * sum_e (share of routed slots to e) * (mean router prob of e); 1 when balanced.
        Over the cached tokens too when a cache is given (kept as per-row sums in it)."""
        batch, seq_len = batch_seq
        if token_mask is None:
            weights = probs.new_ones(batch, seq_len, 1)
        else:
            weights = token_mask[:, -seq_len:, None].float()
        assigned = F.one_hot(top_idx, self.num_experts).float().sum(1).view(batch, seq_len, -1)
        sums = ((assigned * weights).sum(1), (probs.view(batch, seq_len, -1) * weights).sum(1), weights.sum(1))
        if cache is not None:
            sums = cache.accumulate_router_sums(self.layer_idx, sums)
        slots, prob_mass, count = (t.sum(0) for t in sums)
        total = count.clamp(min=1.0)
        slot_share = slots / (total * self.top_k)
        return self.num_experts * (slot_share * prob_mass / total).sum()


class DenseFeedForward(SwiGLU):
    def __init__(self, config: HybridConfig):
        super().__init__(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None, cache: HybridCache | None = None):
        return super().forward(x), x.new_zeros((), dtype=torch.float32)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.is_lightning = config.layer_types[layer_idx] == LINEAR
        attn_cls = LightningAttention if self.is_lightning else SoftmaxAttention
        self.attn = attn_cls(config, layer_idx)
        self.ffn = MoEFeedForward(config, layer_idx) if config.num_experts else DenseFeedForward(config)
        self.attn_norm = HybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = HybridRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, token_mask, rotary, padding, cache):
        h = self.attn_norm(x)
        if self.is_lightning:
            x = x + self.attn(h, token_mask, cache)
        else:
            x = x + self.attn(h, rotary, padding, cache)
        ffn_out, aux_loss = self.ffn(self.ffn_norm(x), token_mask, cache)
        return x + ffn_out, aux_loss


# --------------------------------------------------------------------------- head


class FusedLogprobHead(nn.Linear):
    """The LM head: an ``nn.Linear`` (so checkpoints keep ``lm_head.weight`` and HF utilities
    see an ordinary output embedding) whose forward runs in FP32 and, given labels, scores
    them through the fused kernel instead of returning full-vocabulary logits.

    Every use of the weight happens inside this module's forward on purpose: ZeRO-3 keeps
    parameters partitioned and gathers them only around the owning module's call, so a
    ``lm_head.weight`` read anywhere else would see an empty shard.
    """

    def __init__(self, hidden_size: int, vocab_size: int, device=None, dtype=None):
        super().__init__(hidden_size, vocab_size, bias=False, device=device, dtype=dtype)

    @classmethod
    def adopt(cls, linear: nn.Linear) -> FusedLogprobHead:
        """Wrap a plain bias-free ``nn.Linear`` (what ``resize_token_embeddings`` builds),
        keeping its Parameter object so ties and optimizer references survive."""
        if isinstance(linear, cls):
            return linear
        if linear.bias is not None:
            raise ValueError("the fused log-prob head has no bias; got an nn.Linear with one")
        head = cls(linear.in_features, linear.out_features, device="meta")
        head.weight = linear.weight
        return head

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX):
        """FP32 logits [..., V] without labels; with labels of shape hidden.shape[:-1],
        (FP32 log p(label), entropy of the next-token distribution) at the scored positions,
        0 for both where the label is ``ignore_index``.

        Only the scored positions go through the vocabulary: an SFT row scores its response,
        a few tokens after a prompt of hundreds, and the head's two passes over the vocabulary
        were a fifth of a tiny judge's training step when every position went through them.
        """
        if labels is None:
            return F.linear(hidden.float(), self.weight.float())
        scored = labels != ignore_index
        if bool(scored.all()) or not bool(scored.any()):
            return head_logprobs(hidden, self.weight, labels, ignore_index)
        logp, entropy = head_logprobs(hidden[scored], self.weight, labels[scored], ignore_index)
        zeros = logp.new_zeros(labels.shape)
        return zeros.masked_scatter(scored, logp), zeros.masked_scatter(scored, entropy)


# --------------------------------------------------------------------------- models


@dataclass
class HybridCausalLMOutput(MoeCausalLMOutputWithPast):
    """With labels: ``token_logprobs`` and ``entropy`` of every next token, [B, T-1] FP32 (both 0
    where the label is ignored)."""

    token_logprobs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    config: HybridConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["HybridDecoderLayer"]
    _keep_in_fp32_modules: ClassVar[list[str]] = ["lm_head"]
    _supports_sdpa = True
    # a recurrent state cannot be rewound, so assisted decoding is refused by generate
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not build a DynamicCache: forward creates the HybridCache itself
        return False


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = HybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, HybridCache | None]:
        """Returns (final hidden states, MoE balance loss averaged over layers, cache)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if use_cache and cache is None:
            cache = HybridCache(self.config)
        elif cache is not None and not isinstance(cache, HybridCache):
            raise TypeError(f"{type(self).__name__} needs a HybridCache, got {type(cache).__name__}")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq_len = hidden.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        token_mask = attention_mask.bool() if attention_mask is not None else None

        if position_ids is None:
            position_ids = self._positions(token_mask, past, batch, seq_len, hidden.device)
        rotary = rotary_cos_sin(position_ids, self.config.rotary_dim, self.config.rotary_base, hidden.dtype)
        padding = SoftmaxPadding.of(token_mask, past, seq_len)

        aux_loss = hidden.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            hidden, layer_aux = layer(hidden, token_mask, rotary, padding, cache)
            aux_loss = aux_loss + layer_aux
        if cache is not None:
            cache.advance(seq_len)
        # mean over layers: 1.0 when every MoE layer routes uniformly
        return self.norm(hidden), aux_loss / len(self.layers), cache

    @staticmethod
    def _positions(token_mask, past, batch, seq_len, device):
        if token_mask is None:
            return torch.arange(past, past + seq_len, device=device).expand(batch, -1)
        # count only real tokens, so left padding does not shift positions (matches generate)
        positions = (token_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions[:, -seq_len:]


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.model = HybridModel(config)
        self.lm_head = FusedLogprobHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear):
        self.lm_head = FusedLogprobHead.adopt(new_embeddings)

    def fp32_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head in FP32 whatever the model dtype."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> HybridCausalLMOutput:
        """With ``labels`` (aligned with input_ids, shifted inside, -100 ignored) the loss is the
        mean token NLL from the fused FP32 kernel plus ``router_aux_loss_coef`` * balance loss,
        the per-token log-probs and entropies are returned too, and full-vocabulary logits are
        not built. Without labels, FP32 logits are returned (only the last ``logits_to_keep``
        positions when it is > 0)."""
        hidden, aux_loss, cache = self.model(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache
        )
        if labels is None:
            kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
            return HybridCausalLMOutput(aux_loss=aux_loss, logits=self.lm_head(kept), cache=cache)
        targets = self._shifted_targets(labels, attention_mask)
        logp, entropy = self.lm_head(hidden[:, :-1], targets)
        n_valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
        loss = -logp.sum() / n_valid
        if self.config.num_experts:
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        return HybridCausalLMOutput(loss=loss, aux_loss=aux_loss, cache=cache,
                                    token_logprobs=logp, entropy=entropy)

    @staticmethod
    def _shifted_targets(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        targets = labels[:, 1:]
        if attention_mask is not None:
            # the mask may cover cached tokens too: its last columns are the labels' own
            current = attention_mask[:, attention_mask.shape[1] - targets.shape[1]:]
            targets = targets.masked_fill(current == 0, IGNORE_INDEX)
        return targets

    def fused_token_logprobs(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        with_aux: bool = False,
    ):
        """Per-token FP32 log-probs and entropies of the next token, [B, T-1] each.

        ``logp[:, t] = log p(labels[:, t+1] | input_ids[:, :t+1])``; labels default to
        input_ids, positions with label -100 or attention_mask 0 get log-prob 0. Entropy is
        of the full next-token distribution at each scored position (0 elsewhere). Differentiable (fused kernel
        backward). With ``with_aux`` the MoE balance loss is returned third.

        Runs as a call of this module (not of its parts) so that DeepSpeed's hooks on the
        root module fire: ZeRO-3 resets its parameter-fetch trace there on every pass.
        """
        labels = input_ids if labels is None else labels
        out = self(input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        if with_aux:
            return out.token_logprobs, out.entropy, out.aux_loss
        return out.token_logprobs, out.entropy


def count_parameters(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())


def build_tiny_model(tokenizer, cfg=None, seed: int = 0) -> HybridForCausalLM:
    """A randomly initialised hybrid model for ``tokenizer``; ``cfg`` is a ModelSection,
    HybridSizes or dict of sizes (default: the tiny preset). Seeded for reproducibility."""
    config = build_model_config(tokenizer, cfg)
    torch.manual_seed(seed)
    return HybridForCausalLM(config)
