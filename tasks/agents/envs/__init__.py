"""Environments for agent RL: the interface (``base``), the bundled environments and their registry.

    tool_arithmetic  long arithmetic with a ``calculator`` tool
    feedback         guess a hidden number from the verifier's too-low / too-high feedback
    code_repair      fix a planted bug in a small project with read_file / edit / run_tests
"""
from tasks.agents.envs.base import (
    END_REASONS,
    Action,
    Environment,
    Reset,
    StepResult,
    Tool,
    ToolCall,
)
from tasks.agents.envs.registry import ENVIRONMENTS, env_names, make_env

__all__ = ["END_REASONS", "ENVIRONMENTS", "Action", "Environment", "Reset", "StepResult", "Tool", "ToolCall",
           "env_names", "make_env"]
