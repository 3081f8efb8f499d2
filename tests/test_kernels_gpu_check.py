"""bench/gpu_check.py without a GPU: it says so and exits 0, and its SMALL=1 dry run walks the
kernel sections' code paths at tiny shapes under the Triton interpreter, recording every
figure and judging the accuracy ones (speed is not judged off a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SECTIONS = ("launch", "lightning_accuracy", "lightning_speed", "head_accuracy", "head_speed")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's CPU behaviour")


def run_script(tmp_path, **env):
    env = {**os.environ, "OUT": str(tmp_path), **env}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def test_without_cuda_nothing_is_measured(tmp_path):
    done = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no CUDA: nothing measured" in done.stdout
    assert not (tmp_path / "gpu.jsonl").exists()


def test_small_dry_run_of_the_kernel_sections(tmp_path):
    done = run_script(tmp_path, SMALL="1", TRITON_INTERPRET="1", SECTIONS=",".join(KERNEL_SECTIONS))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert [r["section"] for r in records if r.get("start")] == list(KERNEL_SECTIONS)
    assert not [r for r in records if r.get("error")], done.stdout
    launches = [r for r in records if r.get("check") == "lightning_launch"]
    assert len(launches) == 4 and all(r["ok"] for r in launches)
    fp32 = [r for r in records if r.get("check") == "lightning_vs_naive" and r["dtype"] == "torch.float32"]
    assert fp32 and all(max(r["rel_err"].values()) < 1e-4 for r in fp32)
    heads = {r["impl"]: r["max_abs_logp_err"] for r in records if r.get("check") == "head_vs_fp64"}
    assert heads.keys() == {"triton_tf32x3", "fused_torch", "triton_tf32_control"}
    assert heads["triton_tf32x3"] < 1e-4
    assert {"naive", "fused_torch", "triton"} <= set(
        next(r for r in records if r.get("bench") == "head_fwd_bwd")["ms_and_peak_gib"])
    summary = done.stdout[done.stdout.index("\nfigure"):]
    assert "NOT MET" not in summary and "(dry run: not judged)" in summary
    assert records[-1]["done"] is True
