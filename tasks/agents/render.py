"""One rendering of tools and tool calls over the model's chat template, one parser, and the
token-exact transcript of a multi-turn episode.

Rendering. A chat template that handles ``tools`` (it mentions them) renders them itself
(``apply_chat_template(tools=...)``). For one that does not (SmolLM2's plain ChatML), the
fallback format, documented once here and in the README:
- the tool schemas go in the system message, one JSON object per line inside ``<tools>``;
- the policy calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- a tool's result comes back as a ``user`` turn holding ``<tool_response>...</tool_response>``
  (Hermes' and Qwen2.5's convention; plain templates often refuse a ``tool`` role).
Models that think write ``<think>...</think>`` before their reply.

Token exactness. The ids trained on are the ids sampled: a transcript keeps the sampler's ids of
every policy turn as they came and appends, after each, only the tokens of what the template
adds around the environment's messages (the bridge: the end of the assistant turn when the
policy did not write it, the tool/user turns, the next assistant header). Assistant turns are
never re-encoded (re-encoding a rendered history does not give back the sampled ids: the
peers' most reported multi-turn bug). The loss mask is 1 exactly on sampled ids.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tasks.agents.envs.base import Action, Tool, ToolCall
from tasks.rollout.chat import render_chatml

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
THINK = re.compile(r"^\s*<think>(.*?)(?:</think>|\Z)", re.DOTALL)
THINK_END = "</think>"
# stands in for an assistant turn's content while the template's text around it is measured
_SENTINEL = "\u27e6posttrain-turn\u27e7"

FALLBACK_TOOL_PROMPT = (
    "You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call a tool, write <tool_call>{{\"name\": \"<tool name>\", \"arguments\": {{...}}}}</tool_call> "
    "and stop; its result comes back in the next message, inside <tool_response></tool_response>.")


def template_handles_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument of its own."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def _read_call(block: str) -> ToolCall | str:
    """One ``<tool_call>`` block's call, or what is wrong with it."""
    try:
        payload = json.loads(block.strip())
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        return f"not JSON ({e})"
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return 'expected {"name": "...", "arguments": {...}}'
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    return ToolCall(payload["name"], arguments)


def parse_action(text: str) -> Action:
    """The policy's reply as an ``Action``: its leading thinking, every ``<tool_call>`` block
    (JSON with a string ``name`` and an object ``arguments``; arguments given as a JSON string are
    read too), and the text around them. A block that does not parse gives ``parse_error`` and no
    calls: the environment answers it with an error the policy sees."""
    thinking = ""
    body = text
    think = THINK.match(body)
    if think:
        thinking, body = think.group(1).strip(), body[think.end():]
    calls, errors = [], []
    for block in TOOL_CALL.findall(body):
        call = _read_call(block)
        if isinstance(call, str):
            errors.append(f"{call}: {block.strip()[:80]!r}")
        else:
            calls.append(call)
    visible = TOOL_CALL.sub("", body).strip()
    if errors:
        return Action(visible, (), thinking, parse_error="could not parse the tool call: " + "; ".join(errors))
    return Action(visible, tuple(calls), thinking)


def render_action(action: Action) -> str:
    """An action as the policy writes it (expert demonstrations are rendered through this)."""
    head = f"<think>{action.thinking}</think>\n" if action.thinking else ""
    body = [action.text] if action.text else []
    body += ["<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}) + "</tool_call>"
             for c in action.tool_calls]
    return head + "\n".join(body)


class ToolRenderer:
    """Renders an episode's messages with the tokenizer's chat template and the tools, the one way
    every stage renders agent histories."""

    def __init__(self, tokenizer, tools: list[Tool]):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.native = bool(self.tools) and template_handles_tools(tokenizer)

    def _messages(self, messages: list[dict]) -> list[dict]:
        if self.native:
            return [dict(m) for m in messages]
        out = [{"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
               if m["role"] == "tool" else {"role": m["role"], "content": m.get("content", "")} for m in messages]
        if not self.tools:
            return out
        schemas = "\n".join(json.dumps(t.schema()) for t in self.tools)
        tool_text = FALLBACK_TOOL_PROMPT.format(schemas=schemas)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tool_text}
        else:
            out.insert(0, {"role": "system", "content": tool_text})
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        msgs = self._messages(messages)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            kwargs = {"tools": [t.schema() for t in self.tools]} if self.native else {}
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        text = render_chatml(msgs)
        return text if add_generation_prompt else text[: -len("<|im_start|>assistant\n")]

    def bridge(self, messages: list[dict], observation: list[dict], sampled_eos: str | None) -> str:
        """The text the template puts after the last assistant turn's content, through the
        observation's messages, to the next assistant header; less the end-of-turn token the
        policy sampled itself (``sampled_eos``: its text, None when it stopped otherwise)."""
        history = [*messages[:-1], {"role": "assistant", "content": _SENTINEL}]
        full = self.render(history + observation, add_generation_prompt=True)
        at = full.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template dropped the assistant turn's content: cannot bridge turns")
        after = full[at + len(_SENTINEL):]
        if sampled_eos and after.startswith(sampled_eos):
            after = after[len(sampled_eos):]
        return after


@dataclass
class Turn:
    """One policy turn inside the transcript's ids: ``[start, end)`` are sampled ids; the thinking
    ids are ``[start, think_end)`` (``think_end == start``: no thinking)."""
    start: int
    end: int
    think_end: int
    version: int | None


@dataclass
class Transcript:
    """The ids of an episode as the policy saw and wrote them, with the per-token loss mask (1 on
    sampled ids only), the sampler's log-probs (0 where not sampled) and its turns."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    prompt_length: int = 0

    def extend_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def extend_policy(self, ids: list[int], logprobs: list[float | None] | None, think_tokens: int,
                      version: int | None) -> None:
        start = len(self.ids)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) if x is not None else 0.0 for x in (logprobs or [0.0] * len(ids))]
        self.turns.append(Turn(start, len(self.ids), start + think_tokens, version))

    def context(self, keep_thinking: bool = True, upto: int | None = None) -> list[int]:
        """The ids the policy is shown before ``upto`` (default: all): with ``keep_thinking`` off,
        earlier turns' thinking ids are cut out (M2 keeps them: interleaved thinking)."""
        upto = len(self.ids) if upto is None else upto
        if keep_thinking:
            return self.ids[:upto]
        out, at = [], 0
        for turn in self.turns:
            if turn.start >= upto:
                break
            out += self.ids[at:turn.start]
            at = min(turn.think_end, upto)
        return out + self.ids[at:upto]

    def training_samples(self, keep_thinking: bool = True) -> list[tuple[list[int], list[int], list[float], int]]:
        """(ids, mask, sampler log-probs, turn index of the first trained token) of each training
        sequence: the whole transcript when thinking stays in the history (one sequence, each
        turn's context is its prefix); else one per turn, its context as the policy saw it (earlier
        thinking cut) and only that turn's ids trained. Their shared prefixes merge in the trie."""
        if keep_thinking or not self.turns:
            return [(self.ids, self.mask, self.logprobs, 0)]
        samples = []
        for k, turn in enumerate(self.turns):
            context = self.context(False, turn.start)
            ids = context + self.ids[turn.start:turn.end]
            mask = [0] * len(context) + [1] * (turn.end - turn.start)
            logp = [0.0] * len(context) + self.logprobs[turn.start:turn.end]
            samples.append((ids, mask, logp, k))
        return samples

    def turn_of_token(self) -> list[int]:
        """Per token: the index of the policy turn it belongs to or follows (-1 in the prompt)."""
        out = [-1] * len(self.ids)
        for k, turn in enumerate(self.turns):
            nxt = self.turns[k + 1].start if k + 1 < len(self.turns) else len(self.ids)
            out[turn.start:nxt] = [k] * (nxt - turn.start)
        return out

    def state_dict(self) -> dict:
        return {"ids": self.ids, "mask": self.mask, "logprobs": self.logprobs, "prompt_length": self.prompt_length,
                "turns": [[t.start, t.end, t.think_end, t.version] for t in self.turns]}

    @classmethod
    def from_state(cls, state: dict) -> Transcript:
        return cls(list(state["ids"]), list(state["mask"]), list(state["logprobs"]),
                   [Turn(*t) for t in state["turns"]], state["prompt_length"])


def thinking_tokens(tokenizer, ids: list[int]) -> int:
    """How many of a turn's leading ids are its thinking (through ``</think>``), found on the
    sampled ids themselves (0 when the turn does not open with ``<think>``)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if not THINK.match(text) or THINK_END not in text:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:   # the fewest leading ids whose text holds the closing tag
        mid = (lo + hi) // 2
        if THINK_END in tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def encode_text(tokenizer, text: str) -> list[int]:
    """Template text as ids, without the tokenizer adding special tokens of its own."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
