"""Configuration of the hybrid lightning-attention model, and the profile's ``model`` section.

``HybridConfig`` is the Hugging Face config saved with checkpoints. ``ModelSection`` is the
pydantic model that validates ``configs/profiles/<profile>/model.yaml``; its ``hybrid`` block
holds HybridConfig fields, so a profile can size the model without code changes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedConfig

LINEAR = "linear_attention"
# label of a position that is not trained on (prompt, padding): the one definition, as in torch/HF
IGNORE_INDEX = -100
SOFTMAX = "full_attention"


class HybridConfig(PreTrainedConfig):
    """MiniMax-01-style decoder: lightning (linear) attention layers with a softmax layer every
    ``softmax_attention_every`` layers, optional top-k MoE feed-forward, FP32 LM head."""

    model_type = "posttrain_hybrid"

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int | None = None
    # MiniMax-01: one softmax layer after every seven lightning layers
    softmax_attention_every: int = 8
    layer_types: list[str] | None = None
    # softmax layers rotate only part of each head (MiniMax-01 rotates half)
    partial_rotary_factor: float = 0.5
    rotary_base: float = 10000.0
    max_position_embeddings: int = 8192
    lightning_chunk_size: int = 64
    rms_norm_eps: float = 1e-6
    num_experts: int = 0  # 0: dense SwiGLU feed-forward
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.01
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                SOFTMAX if (i + 1) % self.softmax_attention_every == 0 else LINEAR
                for i in range(self.num_hidden_layers)
            ]
        self._check()
        super().__post_init__(**kwargs)

    def _check(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR, SOFTMAX})
        if unknown:
            raise ValueError(f"layer_types: unknown {unknown}; expected {LINEAR!r} or {SOFTMAX!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each softmax head that get RoPE (even, at least 2)."""
        return max(2, int(self.head_dim * self.partial_rotary_factor) // 2 * 2)


class HybridSizes(BaseModel):
    """Sizes for the in-house hybrid model; vocab and special ids come from the tokenizer."""

    model_config = ConfigDict(extra="forbid")
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    softmax_attention_every: int = 8
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 8192
    lightning_chunk_size: int = 64
    num_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.01


class ModelSection(BaseModel):
    """``model.yaml`` of a profile: build the hybrid model, or load any HF causal LM from a path."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["hybrid", "pretrained"] = "hybrid"
    pretrained_path: str | None = None  # local directory, used when kind == "pretrained"
    tokenizer_vocab_size: int = 2048  # for the tokenizer trained in-house (kind == "hybrid")
    dtype: Literal["float32", "bfloat16"] = "float32"
    hybrid: HybridSizes = Field(default_factory=HybridSizes)


# A small preset (8 layers, MoE feed-forward) for callers without a profile at hand; the tiny
# profile's own shape is in configs/profiles/tiny/model.yaml.
TINY_SIZES = HybridSizes(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    lightning_chunk_size=32,
    num_experts=4,
    num_experts_per_tok=2,
)


def build_model_config(tokenizer, sizes: HybridSizes | ModelSection | dict | None = None) -> HybridConfig:
    """HybridConfig sized by ``sizes`` (default: the tiny preset), vocab and ids from ``tokenizer``."""
    if sizes is None:
        sizes = TINY_SIZES
    elif isinstance(sizes, ModelSection):
        sizes = sizes.hybrid
    elif isinstance(sizes, dict):
        sizes = HybridSizes(**sizes)
    return HybridConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sizes.model_dump(),
    )
