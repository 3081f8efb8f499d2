"""HumanEval-style code verifier: program = prompt + completion + tests + check(entry_point),
run in the sandbox; the score is 1.0 only when every assertion passes.
"""
from __future__ import annotations

import re

from tasks.synth.base import after_thinking
from tasks.verify.sandbox import SandboxLimits, SandboxResult, run_python_sandboxed

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def code_blocks(text: str) -> list[str]:
    """The closed fenced (python or bare) code blocks of ``text``, in order."""
    return _FENCE.findall(text)


def extract_code(response: str) -> tuple[str, bool]:
    """(code, fenced): the last fenced block when there is one, else the raw continuation."""
    text = after_thinking(response)
    blocks = code_blocks(text)
    if blocks:
        return blocks[-1], True
    return text, False


def runnable_prompt(prompt: str) -> str:
    """The prompt as code (a signature + docstring gets a ``pass`` body), or "" for prose."""
    for candidate in (prompt, prompt.rstrip() + "\n    pass\n"):
        try:
            compile(candidate, "prompt", "exec")
            return candidate
        except (SyntaxError, ValueError):
            continue
    return ""


def build_program(prompt: str, response: str, tests: str, entry_point: str | None) -> str:
    """A fenced answer is a full solution (the prompt's code stays above it for imports and
    helpers); an unfenced one continues the prompt's function body, HumanEval-style."""
    code, fenced = extract_code(response)
    solution = f"{runnable_prompt(prompt)}\n\n{code}" if fenced else prompt + code
    check = f"\n\ncheck({entry_point})\n" if entry_point and "def check(" in tests else "\n"
    return f"{solution}\n\n{tests}{check}"


def run_code_tests(
    prompt: str, response: str, tests: str, entry_point: str | None, limits: SandboxLimits | None = None
) -> SandboxResult:
    return run_python_sandboxed(build_program(prompt, response, tests, entry_point), limits)


def verify_code(
    prompt: str, response: str, tests: str | None, entry_point: str | None,
    limits: SandboxLimits | None = None,
) -> float:
    if not tests or not tests.strip():
        return 0.0
    return 1.0 if run_code_tests(prompt, response, tests, entry_point, limits).passed else 0.0
