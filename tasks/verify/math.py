"""Math verifier: pull the final answer out of a response and compare it with math-verify.

The final answer is the last ``<answer>...</answer>`` block (SynLogic/M1 style) or else the
last ``\\boxed{...}``. math-verify then decides equivalence (symbolic, numeric, sets,
intervals), so "1/2", "0.5" and "\\frac{1}{2}" all match.
"""
from __future__ import annotations

import functools
import json
import select
import subprocess
import sys
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

# the answer extractors live with the answer tag, below both synthesis and verification
from tasks.synth.base import extract_final_answer

_TIMEOUT_S = 5
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
# verdicts kept per process: a policy repeats its answers (a group of G samples, the same
# prompt every epoch), and math-verify's LaTeX parse of one answer takes tens of milliseconds
VERDICT_CACHE_SIZE = 65_536


class MathVerifyTimeout(TimeoutError):
    """math-verify did not decide an equivalence within the time limit (a power tower such as
    81^129^28 makes sympy evaluate a number with more digits than atoms in the universe)."""


def _no_verdict(gold: str, predicted: str, why: str) -> MathVerifyTimeout:
    return MathVerifyTimeout(f"no verdict on {predicted[:120]!r} against {gold[:120]!r}{why}")


def _timeout_s() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_math_answer(expression: str) -> list:
    """math-verify's parse of an answer (bare or in $...$ / \\boxed{}); empty when unparseable."""
    seconds = _timeout_s()
    wrapped = expression if "$" in expression or "\\boxed" in expression else f"${expression}$"
    parsed = parse(wrapped, extraction_config=_EXTRACTION, parsing_timeout=seconds)
    if not parsed:
        parsed = parse(expression, extraction_config=_EXTRACTION, parsing_timeout=seconds)
    return parsed


def _equivalent_here(gold: str, predicted: str) -> bool:
    """math-verify's verdict in this thread, with its own (signal) time limit where it has one."""
    gold_parsed, predicted_parsed = parse_math_answer(gold), parse_math_answer(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    try:
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=_timeout_s(), raise_on_error=True))
    except TimeoutException:
        raise _no_verdict(gold, predicted, f" within {_TIMEOUT_S}s") from None
    except Exception:  # noqa: BLE001 - sympy can raise anything on odd input; that is a miss
        return False


class _MathWorker:
    """One child process that decides equivalences for the threads of this process.

    Stage code runs in worker threads (Prefect's task runner, verifier pools), where
    math-verify has no time limit and a single runaway comparison stalls a whole RL stage. The
    child (``python -m tasks.verify._math_worker``: JSON lines over its stdin and stdout, so it
    never re-imports the caller's main module) times out in its own main thread; past twice
    that (stuck in C) it is killed and a new one starts on the next call. It exits when its
    stdin closes, so it never outlives this process. Calls are serialized: a verdict takes
    milliseconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tasks.verify._math_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._reply(120) != {"status": "ready"}:
            self._stop()
            raise RuntimeError("the math-verify worker process did not start within 120 s")

    def _reply(self, seconds: float) -> dict | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], seconds)
        line = self._proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None

    def equivalent(self, gold: str, predicted: str) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps({"gold": gold, "predicted": predicted}) + "\n")
            reply = self._reply(2 * _TIMEOUT_S + 1)
            if reply is None:
                self._stop()
                raise _no_verdict(gold, predicted, f": the math worker was stopped after {2 * _TIMEOUT_S + 1}s")
        if reply["status"] == "timeout":
            raise MathVerifyTimeout(reply["message"])
        return bool(reply["equal"])


class _MathWorkers:
    """The math worker processes of this process: a calling thread takes an idle one, or starts
    one more while fewer than ``limit`` exist, so verifier threads decide side by side instead
    of queueing on one process (a thread pool of N verifiers gets N workers)."""

    def __init__(self, limit: int = 8) -> None:
        self._limit = limit
        self._idle: list[_MathWorker] = []
        self._started = 0
        self._free = threading.Condition()   # guards the two above; notified when a worker is idle again

    def equivalent(self, gold: str, predicted: str) -> bool:
        with self._free:
            while not self._idle and self._started >= self._limit:
                self._free.wait()
            if self._idle:
                worker = self._idle.pop()
            else:
                worker, self._started = _MathWorker(), self._started + 1
        try:
            return worker.equivalent(gold, predicted)
        finally:
            with self._free:
                self._idle.append(worker)
                self._free.notify()


_WORKER = _MathWorkers()


def math_equal(gold: str, predicted: str) -> bool:
    """math-verify equivalence of two answer strings, with exact match as the fallback. Decided
    in this thread when it is the main one, else by a math worker process, so that it ends
    within the time limit from any thread; raises ``MathVerifyTimeout`` when it does not.

    A verdict is a function of the two strings alone, so each pair is decided once per process
    (``VERDICT_CACHE_SIZE`` pairs, least recently used dropped); a timeout is not a verdict and
    is not kept: the pair is tried again when it comes back."""
    if gold.strip() == predicted.strip():
        return True
    return _decided(gold, predicted)


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _decided(gold: str, predicted: str) -> bool:
    if threading.current_thread() is threading.main_thread():
        return _equivalent_here(gold, predicted)
    return _WORKER.equivalent(gold, predicted)


def verify_math(gold: str | None, response: str) -> float:
    """1.0 when the response's final answer equals ``gold``, else 0.0."""
    if gold is None or not str(gold).strip():
        return 0.0
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if math_equal(str(gold), predicted) else 0.0
