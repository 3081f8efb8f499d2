"""Loading a causal LM and its tokenizer for training and sampling, in-house or Hugging Face."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.hybrid import FusedLogprobHead, HybridForCausalLM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers builds a model under process-wide patches (weight init turned off, a meta default
# device, torch.linspace replaced): two loads in threads of one process (the pipeline runs the
# references and the on-policy samples side by side) break each other, one with weights left
# on the meta device, the other with uninitialized (NaN) ones. Loads take turns.
MODEL_LOAD_LOCK = threading.RLock()


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu",
                   zero3_config: dict | None = None):
    """Load (model, tokenizer) from a Hugging Face model directory or a .gguf file.

    The in-house hybrid is registered with ``AutoModelForCausalLM`` when ``model`` is imported,
    which importing this module does.

    With ``zero3_config`` (the DeepSpeed config a ZeRO-3 engine will be created with; every rank
    of its process group calls this together) no rank holds the whole model: transformers builds
    it under ``deepspeed.zero.Init``, so each parameter is partitioned across the ranks as it is
    created, then rank 0 reads the checkpoint and fills one module at a time, its parameters
    gathered for that moment and partitioned again. ``device`` is not applied then: the
    partitions stay where ``zero.Init`` put them (the accelerator's device), for
    ``deepspeed.initialize`` to take over.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    gguf = path.is_file() and path.suffix == ".gguf"
    if gguf and zero3_config is not None:
        raise ValueError(f"{path}: a .gguf file is dequantized whole, it cannot be loaded partitioned (ZeRO-3); "
                         "convert it to a Hugging Face directory first")
    with MODEL_LOAD_LOCK, _zero3_construction(zero3_config):
        if gguf:
            # transformers dequantizes GGUF weights to full precision; the quantizer object it
            # leaves behind only gets in the way of later save/generate calls.
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=_DTYPES[dtype])
            model.hf_quantizer = None
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    reason = adopt_fused_head(model)
    if reason is not None:
        log.warning("%s scores tokens through its own logits, upcast to FP32 (not the fused FP32 head): %s",
                    type(model).__name__, reason)
    if zero3_config is None:
        model = model.to(device)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _zero3_construction(zero3_config: dict | None) -> Iterator[None]:
    """While open, ``from_pretrained`` builds models partitioned under ``deepspeed.zero.Init``
    with ``zero3_config``: transformers looks for an ``HfDeepSpeedConfig`` through a process-wide
    weak reference, so one is kept alive here and the reference cleared on the way out (a later
    plain load in this process must not be partitioned)."""
    if zero3_config is None:
        yield
        return
    stage = zero3_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"a partitioned load needs a ZeRO-3 DeepSpeed config, got ZeRO stage {stage}")
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(zero3_config)
    try:
        yield
    finally:
        del hf_config
        unset_hf_deepspeed_config()


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def _gathered_around_forward(model: nn.Module) -> Iterator[None]:
    """Forward calls of a ZeRO-3 partitioned model outside a DeepSpeed engine: each module's own
    parameters are gathered just before its forward and partitioned again right after (what
    the engine's hooks do), so at most one module's weights are whole at a time on a rank."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    open_contexts: dict[int, list] = {}

    def gather(module, _args):
        params = [p for p in module.parameters(recurse=False)
                  if _is_partitioned(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        context = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        context.__enter__()
        open_contexts.setdefault(id(module), []).append(context)

    def release(module, _args, _output):
        open_contexts[id(module)].pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(gather))
        handles.append(module.register_forward_hook(release))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def adopt_fused_head(model) -> str | None:
    """Route a Hugging Face causal LM's token scoring through the fused FP32 head (M1: the
    train/inference log-prob gap came from the LM head's precision): its ``lm_head`` becomes a
    ``FusedLogprobHead`` holding the same Parameter, so ``model.logprobs.token_logprobs`` scores
    from the decoder's final hidden states and that weight in FP32, never by upcasting
    low-precision logits. Only when the model's logits are exactly ``hidden @ lm_head.weight``,
    checked on a probe forward (soft-capped or scaled logits would be scored wrongly).
    None when adopted (or the model is the in-house hybrid, whose head already is), else why not.
    """
    if isinstance(model, HybridForCausalLM):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(head, FusedLogprobHead):
        return None
    if type(head) is not nn.Linear or head.bias is not None:
        return f"its output embedding is a {type(head).__name__}, not a bias-free nn.Linear"
    if decoder is None or decoder is model:
        return "it exposes no decoder (get_decoder) to take the final hidden states from"
    probe = (torch.arange(1, 9, device=head.weight.device) % head.out_features)[None]
    # a ZeRO-3 partitioned model (loaded under zero.Init) holds only shards: the probe gathers
    # one module at a time, and the head's weight alone for the direct product
    partitioned = _is_partitioned(head.weight)
    if partitioned:
        import deepspeed
    was_training = model.training
    model.eval()
    with torch.no_grad(), (_gathered_around_forward(model) if partitioned else contextlib.nullcontext()):
        logits = model(input_ids=probe).logits.float()
        hidden = decoder(input_ids=probe).last_hidden_state
        with (deepspeed.zero.GatheredParameters([head.weight], modifier_rank=None) if partitioned
              else contextlib.nullcontext()):
            direct = F.linear(hidden.float(), head.weight.float())
    model.train(was_training)
    tolerance = 1e-2 if head.weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if logits.shape != direct.shape or not torch.allclose(logits, direct, rtol=tolerance,
                                                          atol=tolerance * float(direct.abs().max())):
        return "its logits are not its final hidden states times lm_head.weight (post-processed, e.g. soft-capped)"
    model.set_output_embeddings(FusedLogprobHead.adopt(head))
    return None
