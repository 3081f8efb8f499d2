"""The Triton FP32 log-prob head under TRITON_INTERPRET=1: values and gradients against the
full-logits reference and float64, the backward split into row chunks, the explicit dot
precision every launch carries, and the launch's shared-memory and row-chunk budgets at the
issue's scale (16K tokens, D=4096, V=151,936), which the interpreter cannot run.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from test_kernels import (
    assert_all_close,
    assert_interpreted,
    interpreted_module,
    logprob_inputs,
    run_logprob,
    spy_launches,
)

from kernels import head_logprobs, token_logprobs_naive
from kernels.launch_config import (
    GRAD_CHUNK_BYTES,
    HEAD_KERNELS,
    HOPPER_SHARED_MEMORY_BYTES,
    HeadLaunch,
    head_launch,
)

pytest.importorskip("triton")
logprob_triton = interpreted_module("kernels.logprob_triton")

# small tiles and a 5-row chunk: the backward runs four chunks (18 rows), tiles are partial everywhere
SMALL = HeadLaunch(block_rows=16, block_vocab=32, block_dim=16, block_mn=16, block_mk=16, row_chunk=5)


def test_matches_reference_values_and_gradients(monkeypatch):
    assert_interpreted(logprob_triton)
    hidden, weight, labels, g_logp, g_ent = logprob_inputs()
    ref = run_logprob(token_logprobs_naive, hidden, weight, labels, g_logp, g_ent)
    got = run_logprob(logprob_triton.token_logprobs_triton, hidden, weight, labels, g_logp, g_ent,
                      launch=SMALL)
    assert_all_close(got, ref)
    assert got[0][0, 3] == 0.0  # ignored label
    monkeypatch.setenv("POSTTRAIN_KERNEL_BACKEND", "triton")
    via_dispatch = run_logprob(head_logprobs, hidden, weight, labels, g_logp, g_ent)
    assert_all_close(via_dispatch, ref)


def test_fp32_accurate_against_float64():
    """V=1000, D=64: log-probs and entropies within 1e-5 of float64, gradients within 1e-5
    relative (the GPU adds tf32x3's ~1e-6; its default TF32 would add ~1e-3)."""
    gen = torch.Generator().manual_seed(5)
    rows, dim, vocab = 24, 64, 1000
    hidden = torch.randn(rows, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * (3.0 / dim**0.5)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    g_logp, g_ent = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    launch = HeadLaunch(block_rows=16, block_vocab=128, block_dim=32, block_mn=32, block_mk=32, row_chunk=16)
    got = run_logprob(logprob_triton.token_logprobs_triton, hidden, weight, labels, g_logp, g_ent, launch=launch)
    ref = run_logprob(token_logprobs_naive, hidden.double(), weight.double(), labels, g_logp.double(),
                      g_ent.double())
    assert (got[0].double() - ref[0]).abs().max() < 1e-5
    assert (got[1].double() - ref[1]).abs().max() < 1e-5
    for grad, grad_ref in zip(got[2:], ref[2:]):
        assert ((grad.double() - grad_ref).norm() / grad_ref.norm()).item() < 1e-5


def test_every_dot_is_launched_three_pass(monkeypatch):
    """Each launch (forward, then per row chunk: dL/dlogits, d_hidden, d_weight) carries
    input_precision "tf32x3", the default of head_launch; "ieee" can be asked for."""
    assert head_launch(16384, 151_936, 4096).dot_precision == "tf32x3"
    launched = spy_launches(logprob_triton, monkeypatch, keep="DOT_PRECISION")
    hidden, weight, labels, g_logp, g_ent = logprob_inputs()
    run_logprob(logprob_triton.token_logprobs_triton, hidden, weight, labels, g_logp, g_ent, launch=SMALL)
    names = [name for name, _ in launched]
    assert names == ["_logprob_fwd_kernel"] + ["_grad_logits_kernel", "_matmul_kernel", "_matmul_kernel"] * 4
    assert {precision for _, precision in launched} == {"tf32x3"}
    launched.clear()
    ieee = HeadLaunch(16, 32, 16, 16, 16, row_chunk=18, dot_precision="ieee")
    run_logprob(logprob_triton.token_logprobs_triton, hidden, weight, labels, g_logp, g_ent, launch=ieee)
    assert {precision for _, precision in launched} == {"ieee"}


def test_launch_at_issue_scale_fits_memory_budgets():
    """16K tokens, D=4096, V=151,936: every kernel under Hopper's shared memory, and the
    backward's dL/dlogits buffer (row_chunk x V fp32) under GRAD_CHUNK_BYTES (0.5 GiB), the
    head's only buffer beyond its inputs, outputs and gradients (target: under 1 GiB extra)."""
    launch = head_launch(16384, 151_936, 4096)
    assert (launch.block_rows, launch.block_vocab, launch.block_dim, launch.block_mn) == (64, 128, 32, 128)
    for kernel in HEAD_KERNELS:
        assert launch.shared_memory_bytes(kernel) <= HOPPER_SHARED_MEMORY_BYTES
    assert launch.row_chunk == 768 and launch.row_chunk * 151_936 * 4 <= GRAD_CHUNK_BYTES
    small = head_launch(10, 101, 11)
    assert (small.block_rows, small.block_vocab, small.block_dim, small.row_chunk) == (16, 128, 16, 10)
