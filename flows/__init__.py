"""Prefect flows composing tasks, the CLI and deployments."""
from flows._env import apply_defaults

apply_defaults()
