"""Loading the policy partitioned for a ZeRO-3 engine (issue #33, item 4), 2 real DeepSpeed ranks
on CPU (torchrun, gloo).

- Partitioned (``load_causal_lm(..., zero3_config=...)``, built under ``deepspeed.zero.Init``),
  each rank holds half the model's parameters from the start, its peak memory while loading
  stays well under the model's size on the rank that does not read the checkpoint, the fused
  FP32 head is adopted through a gathered probe, and the ZeRO-3 engine scores a batch exactly as
  from a whole load (bench/zero3_memory.py's rank body, on a ~200 MB Llama).
- A ZeRO-3 stage (the in-house hybrid, SFT) loads this way and trains to the same final model
  as the same stage from a whole load.

Run as a script (``--whole-load --job job.json``) this file is a rank of the reference stage: the
stage as it ran before partitioned loading, its policy loaded whole on every rank.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# wide layers over a small vocabulary: no single module is a large share of the model
WIDE_LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 8}


# glibc's mmap threshold fixed in the ranks, as ZeRO-3 stages fix it (engine.malloc_mmap_threshold:
# auto): zero.Init frees each module's whole parameters after partitioning them, and under glibc's
# dynamic threshold those freed blocks stay in the heap as holes the partitions fill only in part
# (the rank then peaks at ~1.4x the model, not ~0.7x)
MMAP_THRESHOLD = 2**20


def test_zero3_ranks_get_a_fixed_mmap_threshold_unless_told_otherwise(monkeypatch):
    from tasks.train.config import EngineConfig
    from tasks.train.engine import MMAP_THRESHOLD_ENV, ZERO3_MMAP_THRESHOLD, rank_env

    monkeypatch.delenv(MMAP_THRESHOLD_ENV, raising=False)
    assert ZERO3_MMAP_THRESHOLD == MMAP_THRESHOLD
    assert rank_env(EngineConfig(zero_stage=3)) == {MMAP_THRESHOLD_ENV: str(MMAP_THRESHOLD)}
    assert rank_env(EngineConfig(zero_stage=2)) == {}                            # glibc's own elsewhere
    assert rank_env(EngineConfig(zero_stage=3, malloc_mmap_threshold="glibc")) == {}
    assert rank_env(EngineConfig(zero_stage=1, malloc_mmap_threshold=65536)) == {MMAP_THRESHOLD_ENV: "65536"}
    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "4096")                                 # the user's own wins
    assert rank_env(EngineConfig(zero_stage=3)) == {}
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        EngineConfig(malloc_mmap_threshold=-1)


def _torchrun(script_args: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    from tasks.train.engine import subprocess_env, torchrun_command

    return subprocess.run(torchrun_command(2, *script_args), cwd=ROOT, env=subprocess_env(env),
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """A random-init Llama of ~200 MB in FP32 beside the tiny Llama's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from model.loading import MODEL_LOAD_LOCK
    from tasks.rollout.tiny_model import build_tiny_llama

    root = tmp_path_factory.mktemp("zero3-models")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_llama(root / "tiny-llama"))
    out = root / "wide-llama"
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **WIDE_LLAMA)
    torch.manual_seed(0)
    with MODEL_LOAD_LOCK:
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ranks(wide_llama, tmp_path_factory) -> list[dict]:
    """Both loads on the same 2 ranks, partitioned first: per rank and mode, the measurements."""
    out = tmp_path_factory.mktemp("zero3-ranks")
    done = _torchrun([str(ROOT / "bench" / "zero3_memory.py"), "--worker", "--model", str(wide_llama),
                      "--out", str(out), "--modes", "sharded", "whole"], timeout_s=300,
                    env={"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_holds_half_the_model_and_peaks_under_it_while_loading(ranks):
    full = ranks[0]["whole"]["model_param_bytes"]
    assert full > 150 * 2**20                                        # big enough to tell apart from noise
    for rank in ranks:
        sharded, whole = rank["sharded"], rank["whole"]
        assert sharded["model_param_bytes"] == full
        assert sharded["held_param_bytes"] == pytest.approx(full / 2, rel=0.01)   # its partitions only
        assert whole["held_param_bytes"] == full                                   # every rank, all of it
        assert sharded["held_param_bytes_in_engine"] == whole["held_param_bytes_in_engine"]
    # in anonymous memory (what a rank really takes; RSS also counts file pages: the checkpoint
    # mapped on rank 0, and code pages first touched by the first load, ~0.07x the model on CI's
    # clean machine) every rank holds its partitions plus one module gathered at a time: ~0.65x
    for rank in ranks:
        assert rank["sharded"]["load_anon_peak_bytes"] < 0.75 * full
    # rank 1 never sees the checkpoint's values (transformers reads them on rank 0 alone, as meta
    # tensors elsewhere): even its RSS peak stays well under that of a whole load (~1.0x the model)
    assert ranks[1]["sharded"]["load_peak_bytes"] < 0.9 * ranks[1]["whole"]["load_peak_bytes"]


def test_the_fused_head_is_adopted_partitioned_and_scores_like_a_whole_load(ranks):
    """adopt_fused_head's probe forward gathers one module at a time under ZeRO-3: the head is
    still adopted, and the ZeRO-3 engine's log-probs equal those from a whole load."""
    import torch

    for rank in ranks:
        assert rank["sharded"]["head"] == rank["whole"]["head"] == "FusedLogprobHead"
        sharded, whole = torch.tensor(rank["sharded"]["logp"]), torch.tensor(rank["whole"]["logp"])
        assert sharded.shape == (2, 23) and bool((sharded < 0).all())
        torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", ["sft_short", "dpo_short"])
def test_a_zero3_stage_loaded_partitioned_trains_to_the_whole_load_model(wh, stage):
    """The SFT and DPO stages on the in-house hybrid at ZeRO-3, 2 ranks: loaded partitioned
    through the harness (the launcher log says so), each trains, and its saved model equals the
    one the same stage saves when every rank loads the policy whole. DPO scores its reference
    through the engine (the partitioned policy cannot run outside it): the same reference
    log-probs as the whole model's."""
    import torch
    from safetensors.torch import load_file
    from test_train_engine import seeded_sft_job, small_config

    from tasks.train.runner import execute_stage

    cfg = small_config(zero_stage=3, num_ranks=2, launcher="torchrun")
    job = seeded_sft_job(wh, cfg, stage_steps=3, run_name="partitioned", stage=stage)
    result = execute_stage(job, timeout_s=300)
    log = (job.stage_path / "launcher.log").read_text()
    assert f"{stage} loads" in log and "partitioned across 2 rank(s) (ZeRO-3; glibc mmap threshold: 1048576)" in log
    steps = [json.loads(line) for line in (job.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["grad_norm"] > 0 for s in steps)

    reference = seeded_sft_job(wh, cfg, stage_steps=3, run_name="whole-load", stage=stage)
    reference.stage_path.mkdir(parents=True, exist_ok=True)
    reference.save(reference.stage_path / "job.json")
    done = _torchrun([__file__, "--whole-load", "--job", str(reference.stage_path / "job.json")], timeout_s=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "partitioned across" not in done.stdout + done.stderr
    reference_steps = [json.loads(line) for line in (reference.stage_path / "steps.jsonl").read_text().splitlines()]
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in reference_steps], abs=1e-5)
    if stage == "dpo_short":
        scored, whole = (json.loads((j.stage_path / "reference_logps.json").read_text()) for j in (job, reference))
        assert scored.keys() == whole.keys() and len(scored) > 0
        for pair_id, logps in whole.items():
            assert scored[pair_id] == pytest.approx(logps, abs=1e-4), pair_id

    trained = load_file(Path(result["path"]) / "model.safetensors")
    expected = load_file(reference.stage_path / "final" / "model.safetensors")
    init = load_file(Path(job.init_model) / "model.safetensors")
    assert trained.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=1e-5, msg=name)
    assert not torch.equal(trained["lm_head.weight"], init["lm_head.weight"])      # it did train


def _whole_load_rank(job_path: Path) -> None:
    """One rank of the reference stage: the policy loaded whole, as before partitioned loading."""
    from tasks.train.harness import StageHarness
    from tasks.train.runner import StageJob, run_stage_here

    StageHarness._partitioned_load_config = lambda self: None
    run_stage_here(StageJob.load(job_path))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--whole-load", action="store_true", required=True)
    parser.add_argument("--job", type=Path, required=True)
    _whole_load_rank(parser.parse_args().job)
