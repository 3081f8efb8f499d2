"""Judge prompt templates: five-grade answer consistency, five-grade reasoning soundness (a gold
worked solution checked before SFT trains on it, M2's LLM-judge cleaning), pairwise comparison, and pairwise
comparison on several dimensions (MiniMax-01's correctness / truthfulness / helpfulness /
harmlessness, each with its own verdict line ``correctness: [[1]]``).

Both ask for reasoning first and a bracketed verdict last (``[[4]]``, ``[[-1]]``): the
brackets make the verdict easy to find in free text and hard to produce by accident.

The instructions come first and the texts to compare last, right before the judge's turn:
a small judge trained from scratch then has the answers it compares a few tokens from its
verdict (measured on the tiny shape: held-out grade accuracy 0.76 after 400 steps with
this order, 0.50 with the instructions between the answers and the verdict).
"""
from __future__ import annotations

GRADE_TEMPLATE = """You are grading a response against the ground-truth answer of a problem.
Judge only whether the response's final answer is consistent with the ground truth.
Use this five-grade scale:
5 - fully consistent: same final answer, stated clearly
4 - consistent final answer, minor presentation issues
3 - partially consistent: incomplete, or correct only up to a small slip
2 - mostly inconsistent: wrong final answer with some correct steps
1 - inconsistent, missing or off-topic
Explain briefly, then end with the grade in double brackets, e.g. [[5]].

[Problem]
{question}

[Ground-truth answer]
{ground_truth}

[Response]
{response}"""

REASONING_TEMPLATE = """You are checking a worked solution to a problem before it is used to teach.
Judge whether its reasoning is sound: every step follows from the problem and the steps before
it, and the steps lead to the stated final answer (which is known to be right).
Use this five-grade scale:
5 - every step is valid and leads to the answer
4 - valid reasoning with small gaps or presentation issues
3 - mostly valid, with a step that is unjustified or unclear
2 - a wrong step, or the answer does not follow from the steps
1 - nonsense, unrelated to the problem, or no reasoning at all
Explain briefly, then end with the grade in double brackets, e.g. [[5]].

[Problem]
{question}

[Final answer]
{answer}

[Worked solution]
{solution}"""

PAIRWISE_TEMPLATE = """You are comparing two answers to the same request.
Decide whether Answer 2 is worse than, similar to, or better than Answer 1 in
helpfulness, correctness and how well it follows the request.
Explain briefly, then end with exactly one verdict in double brackets:
[[-1]] if Answer 2 is worse, [[0]] if they are similar, [[1]] if Answer 2 is better.

[Request]
{question}

[Answer 1]
{first}

[Answer 2]
{second}"""


DIMENSIONS_PAIRWISE_TEMPLATE = """You are comparing two answers to the same request on {count} separate dimensions.
Judge each dimension on its own, ignoring the others:
{dimension_lines}
For each dimension decide whether Answer 2 is worse than (-1), similar to (0) or better than (1) Answer 1.
Explain briefly, then end with one line per dimension, in this order, each with exactly one
verdict in double brackets:
{verdict_lines}

[Request]
{{question}}

[Answer 1]
{{first}}

[Answer 2]
{{second}}"""


def dimensions_template(dimensions) -> str:
    """The pairwise template for ``dimensions`` (objects with ``name`` and ``description``)."""
    return DIMENSIONS_PAIRWISE_TEMPLATE.format(
        count=len(dimensions),
        dimension_lines="\n".join(f"- {d.name}: {d.description}".replace("{", "{{").replace("}", "}}")
                                  for d in dimensions),
        verdict_lines="\n".join(f"{d.name}: [[v]]" for d in dimensions))


def clip(text: str | None, max_chars: int) -> str:
    """Long candidates are cut (with a marker) so one answer cannot crowd out the other."""
    text = "" if text is None else str(text)
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + "\n[... truncated]"


def grade_prompt(question: str, ground_truth: str, response: str, max_chars: int) -> str:
    return GRADE_TEMPLATE.format(question=clip(question, max_chars), ground_truth=clip(ground_truth, max_chars),
                                 response=clip(response, max_chars))


def reasoning_prompt(question: str, answer: str, solution: str, max_chars: int) -> str:
    return REASONING_TEMPLATE.format(question=clip(question, max_chars), answer=clip(answer, max_chars),
                                     solution=clip(solution, max_chars))


def pairwise_prompt(question: str, first: str, second: str, max_chars: int, dimensions=()) -> str:
    """One overall verdict, or with ``dimensions`` one verdict line per dimension."""
    template = dimensions_template(dimensions) if dimensions else PAIRWISE_TEMPLATE
    return template.format(question=clip(question, max_chars), first=clip(first, max_chars),
                           second=clip(second, max_chars))
