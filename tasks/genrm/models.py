"""Which model a judge (or a candidate source) runs: profile aliases resolved against a home.

``rollout.model`` may name:
- ``"policy"`` (``tasks.model_registry.POLICY_MODEL``): the model RL starts from, the
  newest pre-RL row of the home's ``models`` table. A policy SFT-trained on the verdict
  format (``tasks.train.judge_data``) is then its own GenRM judge, as in MiniMax-M1 where
  the reward model is trained from the policy's own lineage.
- a training stage's name (``"judge"``): the newest model that stage produced in the home;
  the judge stage trains one on verdicts from SFT-side synthetic instances.
- ``"tiny-llama"``: the cached random tiny Llama under the home's ``models`` directory.
- anything else: passed on (another alias or a path, resolved by ``make_backend``).

The references flow (``tasks.genrm.references.build_backends``) and the RL stage's GenRM
judge (``tasks.train.rl.judge_backend_factory``) both resolve through ``resolve_rollout``.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import backend_kind
from warehouse import TableRef


def resolve_model_name(model: str, home: str | Path | None, sources: Mapping[str, TableRef] | None = None) -> str:
    """A concrete model path for the home-relative aliases (a stage's or the policy's model as of
    the ``models`` snapshot handed over in ``sources``, else the newest); other names unchanged."""
    from data_specs.stages import STAGE_NAMES
    from tasks.model_registry import POLICY_MODEL, rl_start_model, stage_model
    from tasks.rollout.tiny_model import TINY_LLAMA_NAME, tiny_llama_path
    from warehouse import Warehouse

    if model == POLICY_MODEL:
        return rl_start_model(Warehouse(home), sources=sources)
    if model in STAGE_NAMES:
        return stage_model(Warehouse(home), model, sources=sources)
    if model == TINY_LLAMA_NAME:
        return str(tiny_llama_path(home))
    return model


def resolve_rollout(rollout: RolloutConfig, home: str | Path | None,
                    sources: Mapping[str, TableRef] | None = None) -> RolloutConfig:
    """``rollout`` with its model resolved (the same object when nothing needs resolving)."""
    if not backend_kind(rollout.backend).loads_model:
        return rollout  # an API backend names its model server-side
    resolved = resolve_model_name(rollout.model, home, sources)
    return rollout if resolved == rollout.model else rollout.model_copy(update={"model": resolved})
