"""DeepSpeed engines: one rank in this process (CPU, gloo-style env), or several ranks
started by the ``torchrun`` / ``deepspeed`` launcher as a subprocess.

The optimizer is a torch AdamW instance (M1's betas and eps) so DeepSpeed compiles no
optimizer op; the communication op is compiled once (``make setup``) into the one directory
every entry point uses (``proc.extensions_dir()``), and loaded under a build lock that a killed
build cannot leave stuck (``proc.ensure_comm_op``).
"""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from model.optim import build_adamw
from tasks.train import proc
from tasks.train.config import EngineConfig, OptimizerConfig
from tasks.train.ds_config import deepspeed_config
from warehouse import WRITER_ENV, current_writer

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_bin() -> str:
    return str(Path(sys.executable).parent)


def prepare_environment(engine: EngineConfig) -> None:
    """Process-wide settings every rank needs before DeepSpeed is imported."""
    os.environ.setdefault("DS_ACCELERATOR", engine.accelerator)
    proc.use_extensions_dir()
    # two ninja binaries exist (system and venv); switching between them forces a rebuild
    path = os.environ.get("PATH", "")
    if not path.startswith(_venv_bin()):
        os.environ["PATH"] = _venv_bin() + os.pathsep + path
    if engine.threads_per_rank:
        torch.set_num_threads(engine.threads_per_rank)


def init_single_rank() -> None:
    """Make this process rank 0 of a world of 1 unless a launcher already set the env."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    # port 0: the process group's store binds a free port itself. A port picked here and bound
    # later could be taken in between by another process on the machine (a concurrent run's
    # engine failed with EADDRINUSE on one so picked).
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and world_size() > 1


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` on every rank (pickled; for a step's sampled batch, not for tensors)."""
    if not _distributed():
        return obj
    box = [obj if rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``tensor`` over the ranks (in place; itself on one rank)."""
    if _distributed():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def lr_lambda(optimizer_cfg: OptimizerConfig, total_steps: int):
    """Linear warm-up, then constant or cosine decay to min_lr_ratio."""
    warmup = optimizer_cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if optimizer_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        floor = optimizer_cfg.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def set_lr_factor(engine, factor) -> None:
    """Replace the engine's schedule (a ``LambdaLR``) with ``factor(step)`` x the stage lr, applied
    from the scheduler's current step on (a resumed engine restores the step, not the function)."""
    scheduler = engine.lr_scheduler
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)


def engine_setup(engine_cfg: EngineConfig, gradient_clipping: float | None = None) -> dict:
    """The environment, process group and comm op a DeepSpeed engine needs, and its JSON config
    (the global batch over this process group's ranks)."""
    prepare_environment(engine_cfg)
    init_single_rank()
    proc.ensure_comm_op()   # says so if it waits on another build; clears a dead build's lock
    ds_config = deepspeed_config(engine_cfg, gradient_clipping)
    ds_config["train_batch_size"] = engine_cfg.micro_batch_size * engine_cfg.gradient_accumulation_steps * world_size()
    return ds_config


def create_engine(model: torch.nn.Module, engine_cfg: EngineConfig, optimizer_cfg: OptimizerConfig,
                  lr: float, total_steps: int, gradient_clipping: float | None = None):
    """(DeepSpeed engine, its JSON config) for ``model``."""
    import deepspeed

    ds_config = engine_setup(engine_cfg, gradient_clipping)
    optimizer = build_adamw([p for p in model.parameters() if p.requires_grad], lr=lr,
                            betas=optimizer_cfg.betas, eps=optimizer_cfg.eps,
                            weight_decay=optimizer_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optimizer_cfg, total_steps))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config)
    return engine, ds_config


def _gradient_norm_from_grads(engine) -> float:
    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def backward_and_step(engine, loss, prescaled: bool = False) -> float | None:
    """Backward, then step; the global gradient norm (before clipping) at an accumulation
    boundary, else None.

    DeepSpeed divides each micro-batch loss by the accumulation count (a mean of equal
    micro-batches); ``prescaled`` says the loss already is this micro-batch's exact share
    of the step's loss (the micro losses sum to it), so it is not divided again.

    ZeRO optimizers record the norm during ``step``; at ZeRO-0 with a torch optimizer
    DeepSpeed does not, so it is computed from the gradients before ``step`` clips them.
    """
    engine.backward(loss, scale_wrt_gas=not prescaled)
    boundary = engine.is_gradient_accumulation_boundary()
    manual = _gradient_norm_from_grads(engine) if boundary and engine.zero_optimization_stage() == 0 else None
    engine.step()
    if not boundary:
        return None
    if manual is not None:
        return manual
    recorded = engine.get_global_grad_norm()
    return float(recorded) if recorded is not None else None


def set_gradient_clipping(engine, value: float) -> None:
    """Change the clip threshold of a live engine (M1 lowers it at each length step-up).

    DeepSpeed reads the threshold from its config at every step (ZeRO-0) or keeps a copy
    in its ZeRO optimizer; both are updated.
    """
    engine._config.gradient_clipping = value
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = value


def current_lr(engine) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of launcher-started ranks: the venv's tools first, our packages importable,
    and the stage writing here named (the tables a rank writes record their stage)."""
    env = dict(os.environ)
    env.pop(WRITER_ENV, None)
    if current_writer():
        env[WRITER_ENV] = current_writer()
    env["PATH"] = _venv_bin() + os.pathsep + env.get("PATH", "")
    proc.use_extensions_dir(env)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the launcher sets them per rank
    env.update(extra or {})
    return env


MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
ZERO3_MMAP_THRESHOLD = 2**20


def rank_env(engine_cfg: EngineConfig) -> dict[str, str]:
    """What launcher-started ranks get on top of ``subprocess_env``: glibc's mmap threshold
    (``engine.malloc_mmap_threshold``) unless the environment already sets it."""
    threshold = engine_cfg.malloc_mmap_threshold
    if threshold == "auto":
        threshold = ZERO3_MMAP_THRESHOLD if engine_cfg.zero_stage == 3 else "glibc"
    if threshold == "glibc" or MMAP_THRESHOLD_ENV in os.environ:
        return {}
    return {MMAP_THRESHOLD_ENV: str(threshold)}


def torchrun_command(num_ranks: int, *script_and_args: str) -> list[str]:
    """torchrun starting ``num_ranks`` ranks of a script on this machine. ``--standalone``:
    torchrun's store binds a free port itself and the ranks share it (a port picked here and
    bound seconds later by torchrun could be taken in between by another process)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(num_ranks), *script_and_args]


def launcher_command(engine_cfg: EngineConfig, job_path: Path) -> list[str]:
    entry = str(Path(__file__).with_name("launcher_entry.py"))
    if engine_cfg.launcher == "torchrun":
        return torchrun_command(engine_cfg.num_ranks, entry, "--job", str(job_path))
    if engine_cfg.launcher == "deepspeed":
        return [str(Path(_venv_bin()) / "deepspeed"), "--num_gpus", str(engine_cfg.num_ranks),
                "--master_port", str(free_port()), entry, "--job", str(job_path)]
    # "process" (and "inprocess" started from here: kill-and-resume tests): one rank in a fresh process
    return [sys.executable, entry, "--job", str(job_path)]


def run_launcher(engine_cfg: EngineConfig, job_path: Path, log_path: Path,
                 pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start the ranks; their output goes to ``log_path``. Returns the launcher process, tied to
    this one (``proc.spawn_tied``): it ends when this process dies. ``pass_fds`` (the stage
    directory's lock) stay open in the launcher."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        return proc.spawn_tied(launcher_command(engine_cfg, job_path), cwd=str(REPO_ROOT),
                               env=subprocess_env(rank_env(engine_cfg)),
                               stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds)


def stop_launcher(launcher: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the launcher and every rank it started (SIGTERM to its process group, SIGKILL after
    ``grace_s``; ranks that torchrun starts in sessions of their own die with it)."""
    proc.stop_process_group(launcher, grace_s)
    proc.forget(launcher)
