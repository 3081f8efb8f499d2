"""Models: the hybrid lightning-attention LM, its tokenizer, and builders.

Importing this package registers the hybrid model with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(dir)`` loads a saved hybrid checkpoint.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .config import TINY_SIZES, HybridConfig, HybridSizes, ModelSection, build_model_config
from .hybrid import (
    HybridCache,
    HybridForCausalLM,
    HybridModel,
    build_tiny_model,
    lightning_slopes,
)
from .tokenizer import CHAT_TEMPLATE, REASONING_TAGS, train_tokenizer

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = [
    "CHAT_TEMPLATE",
    "REASONING_TAGS",
    "TINY_SIZES",
    "HybridCache",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridModel",
    "HybridSizes",
    "ModelSection",
    "build_model_config",
    "build_tiny_model",
    "lightning_slopes",
    "train_tokenizer",
]
