"""Curation: M1 quality filters, exact / MinHash / semantic dedup, decontamination, SFT/RL split."""
from tasks.curate.config import CurateConfig
from tasks.curate.pipeline import CurateResult, run_curate

__all__ = ["CurateConfig", "CurateResult", "run_curate"]
