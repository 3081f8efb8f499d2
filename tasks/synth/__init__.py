"""SynLogic-style synthetic logic tasks: seeded generators with difficulty levels, rule-based
verifiers, a reasoning-gym adapter, and automatic difficulty calibration (MiniMax-M1)."""
from tasks.synth.base import SynthTask, TaskError, TaskInstance, extract_answer
from tasks.synth.calibration import calibrate_task, curriculum_levels, rollout_solver
from tasks.synth.config import CalibrationConfig, SynthesizeConfig
from tasks.synth.registry import OWN_TASKS, get_task, own_task_names

__all__ = [
    "OWN_TASKS", "CalibrationConfig", "SynthTask", "SynthesizeConfig", "TaskError", "TaskInstance",
    "calibrate_task", "curriculum_levels", "extract_answer", "get_task", "own_task_names", "rollout_solver",
]
