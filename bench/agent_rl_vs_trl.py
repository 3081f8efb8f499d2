"""Multi-turn tool-use RL: posttrain's ``agent`` stage vs TRL's ``GRPOTrainer`` with an
``environment_factory`` (TRL >= 0.29), both on CPU, no vLLM.

One shared start: SmolLM2-135M-Instruct after ``--sft-steps`` steps of agent SFT (plain torch
AdamW) on the ``tool_arithmetic`` environment's scripted solutions (seeds of their own, away from
the RL and held-out seeds), saved with ``save_pretrained`` (model and tokenizer). Both sides start
from that directory, each in a subprocess of its own (its own threads, memory and wall clock):

- posttrain: the agent stage (``execute_stage``, one in-process DeepSpeed ZeRO-2 fp32 rank), CISPO,
  ``expert_steps: 0``, environment ``tool_arithmetic`` with ``--train-seeds`` training seeds.
- TRL: ``GRPOTrainer(loss_type="cispo")`` whose environment class wraps the same posttrain
  environment: its one public method ``calculator`` steps the environment with that call (so the
  tool's output is the environment's own), and the reward is the environment's verdict
  (``info["outcome"]``) on the final answer, so both sides train on the same reward.

Same training seeds (TRL's dataset holds them in the order posttrain's stage opens its groups,
unshuffled), group size, prompts per step, optimizer steps, per-turn token limit, learning rate,
AdamW betas / eps, gradient clip, temperature, top-p, torch threads.

Tool format. SmolLM2's chat template ignores ``tools``, so posttrain renders its documented
fallback (``tasks.agents.render``): the tool schemas as JSON lines inside ``<tools>`` in a system
message, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results as a user
turn holding ``<tool_response>...</tool_response>``. TRL needs a template that renders tools and
tool calls and is prefix-preserving, plus a response parser; this script supplies both for the
TRL side only (``TRL_CHAT_TEMPLATE``, ``TRL_RESPONSE_TEMPLATE``): a ChatML template that renders
that same fallback format, so both sides see the same ids. The TRL side checks it (prompt ids,
the ids TRL appends after a tool call, the parse of an expert call) and the script prints whether
the two formats agree. The saved TRL model keeps the start's own tokenizer, so all three models are
evaluated under the same rendering.

Then the start, posttrain's model and TRL's model play the same held-out seeds
(``tasks.agents.evaluate``, one seed for the sampler) and the script prints the training wall
times, the held-out success rates, ``ratio TRL / posttrain wall = X.XXx`` and what could not be
made equal.

    .venv/bin/python bench/agent_rl_vs_trl.py [--steps 4 --group-size 4 --prompts-per-step 2 --train-seeds 16]
    # smoke run: --steps 1 --train-seeds 2 --heldout 4 --sft-steps 1
TRL is in the ``bench`` extra (``pip install -e ".[bench]"``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sides import print_peers, report, run_side

ENV = "tool_arithmetic"
SFT_SEED_BASE = 500_000          # the start's demonstrations: seeds neither side trains on nor evaluates
SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
LOCKSTEP = ("TRL's tool loop runs in lockstep: every generation of a batch waits for the slowest turn "
            "(posttrain: windowed FIFO)")
LOCKSTEP_DETAIL = (
    "  (TRL, transformers generate: each tool round is one padded generate() over every rollout still calling "
    "tools, which runs until its longest turn ends, and the step waits for its slowest rollout; posttrain's rounds "
    "are batches too, but a finished trajectory's slot refills with a new one and a step that has its groups pauses "
    "the rest for the next step instead of waiting for them)")
NOT_EQUAL = (
    ("sampler: TRL samples with transformers' generate() on a padded batch, posttrain with its local batched sampler "
     "under the windowed FIFO (same temperature, top-p, per-turn limit)"),
    ("total length: posttrain's max_tokens counts the whole trajectory (prompt included) and ends it there with "
     "outcome 0; TRL's max_completion_length counts every turn and tool result after the prompt, set to max_tokens "
     "minus the longest training prompt; a tool result that would pass it is dropped and the rollout stops"),
    ("turns: posttrain's environment takes max_turns=4 policy turns; TRL's max_tool_calling_iterations=3 gives 4 "
     "generations. A turn with several calls is one environment step in posttrain, one per call in TRL's wrapper"),
    ("malformed tool calls: posttrain answers them with an error observation and the episode goes on; TRL's parser "
     "falls back to plain text, which ends the rollout as an answer (scored by the environment, usually 0). Wrong "
     "argument names or an unknown tool get TRL's own error text instead of the environment's"),
    ("a turn cut at the per-turn limit: posttrain adds the end-of-turn token before the tool result, TRL appends the "
     "tool result right after the cut"),
    ("staleness: posttrain's FIFO may pause trajectories still running at a step's end and resume them under newer "
     "weights (CISPO's clipped weight corrects their stale turns); TRL is on-policy, every rollout finishes in its step"),
    "advantages: posttrain divides by the group's population std (+1e-6), TRL by its sample std (+1e-4)",
    ("normalization: TRL's cispo divides by the tokens of the whole generation batch, posttrain by each group's "
     "tokens, groups averaged (M1's token-level normalization)"),
    ("optimizer: TRL torch AdamW through accelerate, posttrain a DeepSpeed ZeRO-2 engine, one rank on gloo (same lr, "
     "betas, eps, clip, constant schedule)"),
    ("wall scope: both from the start directory to the saved model; posttrain's includes its DeepSpeed engine set-up "
     "and the trajectories table, TRL's the GRPOTrainer construction"),
)

# --------------------------------------------------------------------------- TRL's tool format
# A ChatML template (SmolLM2's, whose default system prompt it keeps when there are no tools) that
# renders tools the way posttrain's fallback does (tasks.agents.render.FALLBACK_TOOL_PROMPT,
# ToolRenderer._messages): the schemas, one JSON object per line, in the system message; a call as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>; a tool result as a user turn. Built from
# posttrain's own prompt text so the two cannot drift apart.


def _jinja_string(text: str) -> str:
    return json.dumps(text)   # a JSON string literal is a Jinja one (\n, \", \\ escapes)


def trl_chat_template() -> str:
    from tasks.agents.render import FALLBACK_TOOL_PROMPT

    head, tail = FALLBACK_TOOL_PROMPT.split("{schemas}")
    head, tail = (s.replace("{{", "{").replace("}}", "}") for s in (head, tail))
    return (
        "{%- if tools -%}"
        "{%- set ns = namespace(schemas='') -%}"
        "{%- for t in tools -%}"
        "{%- set f = t.function if t.function is defined else t -%}"
        "{%- set ns.schemas = ns.schemas ~ ('' if loop.first else '\\n') ~ '{\"type\": \"function\", \"function\": "
        "{\"name\": ' ~ (f.name | tojson) ~ ', \"description\": ' ~ (f.description | tojson) ~ ', \"parameters\": ' ~ "
        "(f.parameters | tojson) ~ '}}' -%}"
        "{%- endfor -%}"
        f"{{%- set tool_text = {_jinja_string(head)} ~ ns.schemas ~ {_jinja_string(tail)} -%}}"
        "{%- if messages[0].role == 'system' -%}"
        "{{- '<|im_start|>system\\n' ~ messages[0].content ~ '\\n\\n' ~ tool_text ~ '<|im_end|>\\n' -}}"
        "{%- else -%}"
        "{{- '<|im_start|>system\\n' ~ tool_text ~ '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- elif messages[0].role != 'system' -%}"
        f"{{{{- '<|im_start|>system\\n' ~ {_jinja_string(SMOL_DEFAULT_SYSTEM)} ~ '<|im_end|>\\n' -}}}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' and loop.first and tools -%}"
        "{%- elif m.role == 'tool' -%}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response><|im_end|>\\n' -}}"
        "{%- elif m.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if m.reasoning_content -%}{{- '<think>' ~ m.reasoning_content ~ '</think>\\n' -}}{%- endif -%}"
        "{%- if m.content -%}{{- m.content -}}{%- endif -%}"
        "{%- for c in (m.tool_calls or []) -%}"
        "{%- set f = c.function if c.function is defined else c -%}"
        "{%- set args = (f.arguments | tojson) if f.arguments is mapping else f.arguments -%}"
        "{{- ('\\n' if (m.content or not loop.first) else '') ~ '<tool_call>{\"name\": ' ~ (f.name | tojson) ~ "
        "', \"arguments\": ' ~ args ~ '}</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- else -%}"
        "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


# How TRL (transformers' parse_response) reads a sampled turn back into a message: leading
# <think>...</think> as reasoning, each <tool_call> block as JSON, the rest as content up to <|im_end|>
TRL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


class ArithmeticTools:
    """TRL's environment: posttrain's ``tool_arithmetic`` behind TRL's interface. TRL turns every
    public method into a tool (its schema from the signature and docstring), calls ``reset`` with
    the dataset row before each rollout, and here a reward function reads the verdict."""

    def __init__(self):
        from tasks.agents.envs import make_env

        self._env = make_env(ENV)
        self._info: dict | None = None      # the episode's final info once it ended
        self._calls = 0

    def reset(self, seed, **_) -> None:
        self._env.reset(int(seed))
        self._info, self._calls = None, 0    # the prompt is the dataset row's (the opening)

    def calculator(self, expression: str) -> str:
        # the docstring is set below from posttrain's tool, so TRL's schema is the environment's
        from tasks.agents.envs import Action, ToolCall

        self._calls += 1
        if self._info is not None:
            return "error: the episode is over"
        result = self._env.step(Action("", (ToolCall("calculator", {"expression": expression}),)))
        if result.done:
            self._info = result.info
        return "\n".join(m["content"] for m in result.observation)

    def _verdict(self, final: dict | None) -> dict:
        """The environment's verdict on the rollout's last message: an answer (no tool call) is
        stepped as the final turn; a rollout that ended on a tool call or a dropped tool result
        gave no answer (outcome 0, as posttrain's max_turns / max_tokens endings)."""
        from tasks.agents.envs import Action

        if self._info is None:
            if final is not None and final.get("role") == "assistant" and not final.get("tool_calls"):
                self._info = self._env.step(Action(final.get("content") or "")).info
            else:
                self._info = {"outcome": 0.0, "success": False, "ended": "no_answer"}
        return self._info


def _calculator_doc() -> str:
    from tasks.agents.envs.tool_arithmetic import CALCULATOR

    arg = CALCULATOR.parameters["properties"]["expression"]["description"]
    return f"{CALCULATOR.description}\n\nArgs:\n    expression: {arg}\n"


ArithmeticTools.calculator.__doc__ = _calculator_doc()


# --------------------------------------------------------------------------- the shared start

def build_start(args, base: Path, out: Path) -> dict:
    """SmolLM2 (``base``) after ``args.sft_steps`` agent-SFT steps on expert demonstrations, saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.agents.rollout import EpisodeSpec
    from tasks.train.agent import expert_trajectory, sft_loss_over_trie, training_samples

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, started = [], time.perf_counter()
    for step in range(args.sft_steps):
        seeds = [SFT_SEED_BASE + step * args.sft_batch + i for i in range(args.sft_batch)]
        demos = [expert_trajectory(tokenizer, EpisodeSpec(ENV, {}, s, f"{ENV}:{s}"), f"x{s}") for s in seeds]
        samples = [x for t in demos if t is not None for x in training_samples(t, [1.0] * len(t.transcript.turns), True)]
        loss = sft_loss_over_trie(model, samples, 4096)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(round(loss.item(), 4))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"losses": losses, "seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- posttrain

def train_config(args, start: str):
    from tasks.train.config import TrainConfig

    return TrainConfig(
        seed=0, base_model={"kind": "pretrained", "name": "start", "pretrained_path": start},
        optimizer={"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-15, "weight_decay": 0.0, "schedule": "constant",
                   "warmup_steps": 0},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 1, "threads_per_rank": args.threads,
                "gradient_clipping": 1.0},
        agent={"steps": args.steps, "checkpoint_every": args.steps, "expert_steps": 0,
               "environments": [{"name": ENV, "train_seeds": args.train_seeds}],
               "loss": "cispo", "eps_low": 1.0, "eps_high": args.eps_high, "group_size": args.group_size,
               "tasks_per_step": args.prompts_per_step, "window": args.prompts_per_step * args.group_size,
               "max_turn_tokens": args.max_turn_tokens, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "top_p": 1.0, "process_reward": 0.0, "time_cost": 0.0,
               "dynamic_sampling": False})


def write_tasks(args, home: Path, start: str) -> list[int]:
    """The ``agent_tasks`` table the stage trains on, and the training seeds in the order the
    stage opens its groups (``tasks.train.agent.task_order`` over the tasks sorted by id)."""
    from transformers import AutoTokenizer

    from tasks.train.agent import task_order
    from tasks.train.data import write_training_tables
    from warehouse import Warehouse

    wh = Warehouse(home)
    cfg = train_config(args, start)
    refs, _ = write_training_tables(wh, cfg, AutoTokenizer.from_pretrained(start), ["agent_tasks"])
    ref = refs["agent_tasks"]
    rows = sorted(wh.read(ref.name, ref.snapshot).to_dicts(), key=lambda r: r["task_id"])
    order = task_order(rows, cfg.seed, args.steps * args.prompts_per_step)
    return [int(rows[i]["seed"]) for i in order]


def run_posttrain(args, home: Path) -> dict:
    from tasks.train import checkpoint
    from tasks.train.runner import StageJob, execute_stage
    from warehouse import Warehouse

    start = str(home / "start")
    ref = Warehouse(home).latest("agent_tasks")
    # a run name of its own: a --home used before holds a finished stage that would not train again
    job = StageJob(stage="agent", home=str(home), run_name=f"bench-{time.strftime('%Y%m%d-%H%M%S')}", profile="bench",
                   init_model=start, data_ref=str(ref), config=train_config(args, start).model_dump(),
                   fingerprint="agent-rl-vs-trl")
    began = time.perf_counter()
    result = execute_stage(job)
    seconds = time.perf_counter() - began
    curve = checkpoint.StepLog(job.stage_path, enabled=False).records()
    return {"seconds": seconds, "path": result["path"], "step_seconds": sum(r["step_seconds"] for r in curve),
            "success": [round(r["success_rate"], 3) for r in curve],
            "tool_calls": [round(r["tool_calls_mean"], 2) for r in curve]}


# --------------------------------------------------------------------------- TRL

def _format_check(trainer, tokenizer, start_tokenizer, seed: int) -> dict:
    """Whether TRL, through its own code paths, builds the ids posttrain builds: the prompt, the
    ids it appends after a tool call, and the parse of the expert's call turn."""
    from trl.chat_template_utils import parse_response

    from tasks.agents.envs import make_env
    from tasks.agents.render import ToolRenderer, encode_text, render_action

    env = make_env(ENV)
    reset = env.reset(seed)
    renderer = ToolRenderer(start_tokenizer, reset.tools)
    ours = encode_text(start_tokenizer, renderer.render(reset.messages, add_generation_prompt=True))
    theirs = tokenizer.apply_chat_template([reset.messages], tools=trainer._env_tools[None], add_generation_prompt=True,
                                           chat_template=trainer.chat_template, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    call = env.expert_actions(seed)[0]
    call_ids = encode_text(start_tokenizer, render_action(call)) + [start_tokenizer.eos_token_id]
    parsed = parse_response(tokenizer, call_ids, prefix=theirs, tools=trainer._env_tools[None])
    observation = env.step(call).observation
    history = [*reset.messages, {"role": "assistant", "content": render_action(call)}]
    bridge = encode_text(start_tokenizer, renderer.bridge(history, observation, start_tokenizer.eos_token))
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": m["name"], "content": m["content"]}
                                           for m in observation])
    calls = parsed.get("tool_calls") or []
    return {"prompt_ids_equal": list(theirs) == ours, "tool_result_ids_equal": list(suffix) == bridge,
            "call_parsed": [c["function"] for c in calls] == [{"name": c.name, "arguments": c.arguments}
                                                               for c in call.tool_calls],
            "template_kept": trainer.chat_template is None}


def run_trl(args, home: Path) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.agents.envs import make_env
    from tasks.agents.render import ToolRenderer, encode_text

    start = home / "start"
    seeds = json.loads((home / "trl_seeds.json").read_text())
    start_tokenizer = AutoTokenizer.from_pretrained(start)
    probe = make_env(ENV)
    prompts = {s: probe.reset(s).messages for s in set(seeds)}
    longest = max(len(encode_text(start_tokenizer, ToolRenderer(start_tokenizer, probe.reset(s).tools)
                                  .render(m, add_generation_prompt=True))) for s, m in prompts.items())
    dataset = Dataset.from_list([{"prompt": prompts[s], "seed": s} for s in seeds])
    outcomes: list[float] = []
    calls: list[int] = []

    def outcome(completions, environments, **_):
        """posttrain's verdict: the environment's outcome on the rollout's final answer."""
        out = [float(env._verdict(c[-1] if c else None)["outcome"]) for c, env in zip(completions, environments)]
        outcomes.extend(out)
        calls.extend(env._calls for env in environments)
        return out

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds, self._at = 0.0, 0.0

        def on_step_begin(self, *a, **k):
            self._at = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds += time.perf_counter() - self._at

    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.chat_template = trl_chat_template()
    tokenizer.response_template = TRL_RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    out_dir = home / "trl"
    config = GRPOConfig(
        output_dir=str(out_dir), loss_type="cispo", epsilon_high=1 + args.eps_high, beta=0.0,
        num_generations=args.group_size, per_device_train_batch_size=args.prompts_per_step * args.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=args.steps,
        max_completion_length=args.max_tokens - longest, generation_kwargs={"max_new_tokens": args.max_turn_tokens},
        max_tool_calling_iterations=probe.max_turns - 1, temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-15, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", seed=0, shuffle_dataset=False, scale_rewards="group",
        dataloader_num_workers=0)
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[outcome], args=config, train_dataset=dataset,
                          processing_class=tokenizer, environment_factory=ArithmeticTools, callbacks=[clock])
    check_seconds = time.perf_counter()
    formats = _format_check(trainer, tokenizer, start_tokenizer, seeds[0])
    check_seconds = time.perf_counter() - check_seconds
    trainer.train()
    final = out_dir / "final"
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(final)
    start_tokenizer.save_pretrained(final)   # the start's own template: evaluated as the others are
    seconds = time.perf_counter() - began - check_seconds
    per_step = args.prompts_per_step * args.group_size
    return {"seconds": seconds, "path": str(final), "step_seconds": clock.seconds, "formats": formats,
            "max_completion_length": args.max_tokens - longest,
            "success": [round(sum(outcomes[i:i + per_step]) / per_step, 3) for i in range(0, len(outcomes), per_step)],
            "tool_calls": [round(sum(calls[i:i + per_step]) / per_step, 2) for i in range(0, len(calls), per_step)]}


# --------------------------------------------------------------------------- held-out

def heldout_success(paths: dict[str, str], args) -> dict[str, tuple[float, float]]:
    """Every model on the same held-out seeds with the same sampler and seed: (success rate,
    mean sampled tokens per episode)."""
    from tasks.agents.evaluate import AgentHeldout, evaluate_agent
    from tasks.rollout.config import LocalConfig
    from tasks.rollout.local import LocalBackend

    cfg = AgentHeldout(environments=[{"name": ENV}], seeds=args.heldout, max_turn_tokens=args.max_turn_tokens,
                       max_tokens=args.max_tokens, window=args.heldout_window)
    out = {}
    for name, path in paths.items():
        began = time.perf_counter()
        backend = LocalBackend.from_path(path, LocalConfig(batch_size=args.heldout_window, threads=args.threads))
        scores = evaluate_agent(backend, cfg, 1.0, args.eval_top_p, 0)
        n = sum(s.n for s in scores)
        out[name] = (sum(s.successes for s in scores) / n, sum(s.mean_tokens * s.n for s in scores) / n)
        print(f"held-out {name}: {out[name][0]:.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
    return out


# --------------------------------------------------------------------------- main

def side_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    home = Path(args.home)
    os.environ["POSTTRAIN_HOME"] = str(home)
    report((run_posttrain if args.side == "posttrain" else run_trl)(args, home))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="RL optimizer steps, both sides")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--train-seeds", type=int, default=16)
    ap.add_argument("--max-turn-tokens", type=int, default=96, help="sampled tokens per turn (an expert call is ~60)")
    ap.add_argument("--max-tokens", type=int, default=768, help="a trajectory's whole length, prompt included")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eps-high", type=float, default=0.2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sft-steps", type=int, default=3, help="agent-SFT steps of the shared start")
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--start", help="reuse a start directory built before (skips the SFT)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out seeds")
    ap.add_argument("--heldout-window", type=int, default=16)
    ap.add_argument("--eval-top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--home", help="where models and tables go (default: a temporary directory)")
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.side:   # the parent: which peer versions these figures come from
        print_peers("trl", "transformers", "torch")
    if args.side:
        side_main(args)
        return
    import shutil

    import torch

    from tasks.rollout.smol import smollm2_path

    torch.set_num_threads(args.threads)
    base = smollm2_path()   # converted once under the caller's POSTTRAIN_HOME, not the run's
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.home or tmp)
        home.mkdir(parents=True, exist_ok=True)
        os.environ["POSTTRAIN_HOME"] = str(home)
        start = home / "start"
        if args.start:
            if Path(args.start).resolve() != start.resolve():
                shutil.copytree(args.start, start, dirs_exist_ok=True)
            print(f"start: {args.start} (reused)", flush=True)
        else:
            built = build_start(args, base, start)
            print(f"start: SmolLM2-135M-Instruct + {args.sft_steps} agent-SFT steps (batch {args.sft_batch}, lr "
                  f"{args.sft_lr}), loss {built['losses']}, {built['seconds']:.1f} s", flush=True)
        seeds = write_tasks(args, home, str(start))
        (home / "trl_seeds.json").write_text(json.dumps(seeds))
        print(f"{args.train_seeds} training seeds of {ENV}; {args.steps} steps x {args.prompts_per_step} prompts x "
              f"{args.group_size} trajectories, {args.max_turn_tokens} tokens a turn, {args.max_tokens} in all, lr "
              f"{args.lr}, T {args.temperature}, {args.threads} threads; seeds by step {seeds}", flush=True)
        results = {}
        for side in ("posttrain", "trl"):
            results[side] = run_side(__file__, side, ["--home", str(home)])
            r = results[side]
            print(f"{side}: {r['seconds']:.1f} s ({r['step_seconds']:.1f} s in its steps), training success per "
                  f"step {r['success']}, tool calls per trajectory {r['tool_calls']}", flush=True)
        scores = heldout_success({"start": str(start), "posttrain": results["posttrain"]["path"],
                                  "trl": results["trl"]["path"]}, args)
    ours, trl = results["posttrain"], results["trl"]
    formats = trl["formats"]
    print(f"held-out success ({args.heldout} seeds of {ENV}, T 1.0, top-p {args.eval_top_p}): "
          f"start {scores['start'][0]:.3f}   posttrain {scores['posttrain'][0]:.3f}   trl {scores['trl'][0]:.3f}"
          f"   (sampled tokens per episode {scores['start'][1]:.0f} / {scores['posttrain'][1]:.0f} / "
          f"{scores['trl'][1]:.0f})")
    print(f"wall (start dir -> trained model): posttrain {ours['seconds']:.1f} s   trl {trl['seconds']:.1f} s")
    print(f"ratio TRL / posttrain wall = {trl['seconds'] / ours['seconds']:.2f}x   (steps only: "
          f"{trl['step_seconds'] / max(ours['step_seconds'], 1e-9):.2f}x)")
    print(LOCKSTEP)
    print(LOCKSTEP_DETAIL)
    if all(formats.values()):
        print("tool format: the same on both sides (TRL's prompt ids, the ids it appends after a tool call and its "
              "parse of an expert call match posttrain's fallback rendering)")
    else:
        print(f"tool format: the two sides' tool formats differ: {formats}")
    print(f"not equal: TRL max_completion_length {trl['max_completion_length']} (= {args.max_tokens} - the longest "
          "training prompt)")
    for line in NOT_EQUAL:
        print(f"not equal: {line}")


if __name__ == "__main__":
    main()
