"""A reward for RL stages a launcher starts in other processes (``StageJob.extra["reward_fn"]``),
shaped so dynamic sampling falls short: every sample of a web_of_lies prompt scores 0 (its group
is never informative, so it is dropped), the others score by the parity of their first token."""


def parity_except_web_of_lies(row: dict, text: str, token_ids: list[int]) -> float:
    if row.get("task") == "web_of_lies":
        return 0.0
    return 1.0 if token_ids and token_ids[0] % 2 == 0 else 0.0
