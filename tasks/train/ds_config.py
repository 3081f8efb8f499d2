"""The DeepSpeed JSON of a stage, generated from the profile (never written by hand)."""
from __future__ import annotations

from tasks.train.config import EngineConfig


def deepspeed_config(engine: EngineConfig, gradient_clipping: float | None = None) -> dict:
    """ZeRO stage, precision, clipping and accumulation for ``engine``.

    The optimizer is a torch AdamW instance handed to ``deepspeed.initialize`` (so no
    DeepSpeed optimizer op is compiled), which ZeRO accepts only with
    ``zero_allow_untested_optimizer``.
    """
    zero: dict = {"stage": engine.zero_stage}
    if engine.zero_stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True)
    if engine.offload_optimizer and engine.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": engine.micro_batch_size,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "train_batch_size": engine.micro_batch_size * engine.gradient_accumulation_steps * engine.num_ranks,
        "gradient_clipping": engine.gradient_clipping if gradient_clipping is None else gradient_clipping,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if engine.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config
