"""Two threads of one process load models at once (the pipeline runs the references and the
on-policy samples side by side): transformers loads under process-wide patches, so without
``model.loading.MODEL_LOAD_LOCK`` one load left weights on the meta device and the other read
uninitialized (NaN) ones (seen in a `smol` pipeline run)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from model.loading import load_causal_lm
from tasks.rollout.tiny_model import tiny_llama_path


def test_loads_in_two_threads_give_whole_finite_models(tmp_path):
    path = tiny_llama_path(home=tmp_path)
    reference = {n: p.detach().clone() for n, p in load_causal_lm(path)[0].named_parameters()}

    def load(_):
        model, _ = load_causal_lm(path)
        return {n: p.detach() for n, p in model.named_parameters()}

    with ThreadPoolExecutor(max_workers=2) as pool:
        loaded = list(pool.map(load, range(8)))
    for params in loaded:
        assert params.keys() == reference.keys()
        for name, value in params.items():
            assert not value.is_meta, name
            assert torch.equal(value, reference[name]), name
