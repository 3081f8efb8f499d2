"""The environments by name: a new environment is its file plus one line in ``ENVIRONMENTS``.

Settings come from the profile as keyword arguments of the environment's constructor; a name or
setting the profile gets wrong fails here, naming what is known, rather than deep in a rollout.
"""
from __future__ import annotations

import inspect

from tasks.agents.envs.base import Environment
from tasks.agents.envs.code_repair import CodeRepair
from tasks.agents.envs.feedback import Feedback
from tasks.agents.envs.tool_arithmetic import ToolArithmetic

ENVIRONMENTS: dict[str, type[Environment]] = {cls.name: cls for cls in (
    ToolArithmetic,
    Feedback,
    CodeRepair,
)}


def env_names() -> list[str]:
    return sorted(ENVIRONMENTS)


def env_settings(name: str) -> list[str]:
    """The settings environment ``name`` takes (its constructor's keyword arguments)."""
    parameters = inspect.signature(_environment(name).__init__).parameters
    return [p for p in parameters if p != "self"]


def make_env(name: str, **settings) -> Environment:
    """Environment ``name`` built with the profile's ``settings``."""
    known = env_settings(name)
    for setting in settings:
        if setting not in known:
            raise ValueError(f"environment {name!r} has no setting {setting!r} "
                             f"(its settings: {', '.join(known)})")
    return _environment(name)(**settings)


def _environment(name: str) -> type[Environment]:
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r} (known: {', '.join(env_names())})") from None
