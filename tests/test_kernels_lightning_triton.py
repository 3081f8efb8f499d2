"""The chunk-parallel Triton lightning attention against the naive quadratic form, forward and
backward, under TRITON_INTERPRET=1: every head dim the model may use (32-256), with and
without an initial state, ragged last chunks, packed variable-length sequences, bf16; plus the
launch configurations' shared-memory needs and the 64-bit offsets, which the interpreter
cannot exercise by running out of either.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from test_kernels import (
    assert_all_close,
    assert_interpreted,
    assert_relative_error,
    interpreted_module,
    lightning_inputs,
    run_lightning,
    spy_launches,
)

from kernels import lightning_attn, lightning_attn_chunk, lightning_attn_naive
from kernels.launch_config import (
    HOPPER_SHARED_MEMORY_BYTES,
    KERNELS,
    LightningLaunch,
    estimate_shared_memory,
    launch_table,
    lightning_launch,
)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
lightning_triton = interpreted_module("kernels.lightning_triton")

SEQ = 40  # chunks of 16: two full, one ragged
RAGGED_LENGTHS = (5, 0, 37, 16)  # packed: one short, one empty, one ragged, one exactly a chunk


@pytest.fixture(scope="module")
def lt():
    assert_interpreted(lightning_triton)
    return lightning_triton


@pytest.fixture
def interpreter_bf16_as_on_gpu(monkeypatch):
    """A fake of the GPU's bf16 arithmetic for the interpreter, which stores bf16 as raw uint16
    and gets two things wrong: tl.dot multiplies the bit patterns, and fp32 -> bf16 casts
    truncate. Here dot operands are widened to fp32 first (tensor cores multiply bf16 exactly
    and accumulate in fp32) and casts round to nearest even, as the GPU's do."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def widened_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        def widen(x):
            return self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
        return dot(self, widen(a), widen(b), acc, input_precision, max_num_imprecise_acc)

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", widened_dot)
    monkeypatch.setattr(builder, "cast_impl", rounding_cast)


def interpreter_launch(dim: int, element_bytes: int = 4) -> LightningLaunch:
    """The launch for ``dim`` at chunk 16, with tiles of half the head dim (at least 16): every
    kernel then loops over two or more tiles, as on the GPU, in fewer interpreted programs."""
    tile = max(16, dim // 2)
    return LightningLaunch(block_t=16, block_k=tile, block_v=tile, num_warps=4, num_stages=2,
                           element_bytes=element_bytes)


# ----------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
@pytest.mark.parametrize("use_h0", [True, False])
def test_matches_naive_for_every_head_dim(lt, dim, use_h0):
    """Output, final state and dq, dk, dv (and dh0) at fp32-level accuracy."""
    inputs, slope, d_out, d_state = lightning_inputs(seq=SEQ, k_dim=dim, v_dim=dim, scale=0.5)
    ref = run_lightning(lightning_attn_naive, inputs, slope, d_out, d_state, use_h0)
    got = run_lightning(lt.lightning_attn_triton, inputs, slope, d_out, d_state, use_h0,
                        chunk_size=16, launch=interpreter_launch(dim))
    assert_relative_error(got, ref, 1e-5)


def test_default_launch_with_unequal_key_and_value_dims(lt):
    """The tiles lightning_launch picks itself (fp32: 32 wide, so value dim 80 spans three
    tiles, the last one partial), and a chunk_size that is not a power of two."""
    inputs, slope, d_out, d_state = lightning_inputs(seq=SEQ, k_dim=16, v_dim=80)
    ref = run_lightning(lightning_attn_naive, inputs, slope, d_out, d_state)
    got = run_lightning(lt.lightning_attn_triton, inputs, slope, d_out, d_state, chunk_size=12)
    assert_all_close(got, ref)


@pytest.mark.parametrize("use_h0", [True, False])
def test_packed_sequences_match_per_sequence_reference(lt, use_h0):
    """cu_seqlens: each sequence starts from its own initial state and ends in its own final
    state; an empty sequence passes its initial state through."""
    cu_seqlens = torch.tensor([0, *torch.tensor(RAGGED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    inputs, slope, d_out, _ = lightning_inputs(seq=int(cu_seqlens[-1]), k_dim=32, v_dim=48)
    q, k, v, _ = inputs
    h0 = torch.randn(len(RAGGED_LENGTHS), 2, 32, 48, generator=torch.Generator().manual_seed(3))
    d_state = torch.randn_like(h0)
    packed = (q, k, v, h0)
    ref = run_lightning(lightning_attn_naive, packed, slope, d_out, d_state, use_h0, cu_seqlens=cu_seqlens)
    got = run_lightning(lt.lightning_attn_triton, packed, slope, d_out, d_state, use_h0, chunk_size=16,
                        cu_seqlens=cu_seqlens, launch=interpreter_launch(64))
    assert_relative_error(got, ref, 1e-5)
    # the reference's packed form is the per-sequence calls it claims to be
    first = lightning_attn_naive(q[:, :, :5], k[:, :, :5], v[:, :, :5], slope, h0[:1] if use_h0 else None, True)
    torch.testing.assert_close(ref[0][:, :, :5], first[0])
    torch.testing.assert_close(ref[1][:1], first[1])
    if use_h0:
        torch.testing.assert_close(ref[1][1], h0[1])  # the empty sequence


def test_bf16_inputs_within_target(lt, interpreter_bf16_as_on_gpu):
    """bf16 q, k, v (fp32 accumulation, per-chunk states in bf16): relative error <= 3e-3 vs
    the naive form on the same bf16 values and upstream gradients, where rounding the exact
    result to bf16 alone costs ~1.7e-3."""
    inputs, slope, d_out, d_state = lightning_inputs(seq=150, k_dim=64, v_dim=64, scale=0.5, silu=True)
    q, k, v, h0 = inputs
    bf16 = [x.bfloat16() for x in (q, k, v)] + [h0]
    ref = run_lightning(lightning_attn_naive, [x.float() for x in bf16], slope,
                        d_out.bfloat16().float(), d_state)
    got = run_lightning(lt.lightning_attn_triton, bf16, slope, d_out, d_state, chunk_size=64)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert_relative_error(got, ref, 3e-3)


def test_scale_and_dispatch_pick_the_chunk_parallel_kernels(lt, monkeypatch):
    inputs, slope, d_out, d_state = lightning_inputs(seq=20)
    ref = run_lightning(lightning_attn_naive, inputs, slope, d_out, d_state, scale=0.25)
    launched = spy_launches(lt, monkeypatch)
    monkeypatch.setenv("POSTTRAIN_KERNEL_BACKEND", "triton")
    got = run_lightning(lightning_attn, inputs, slope, d_out, d_state, scale=0.25, chunk_size=16)
    assert_all_close(got, ref)
    assert [name for name, _ in launched] == [
        "_state_scan_kernel", "_value_tile_kernel", "_state_scan_kernel", "_state_scan_kernel",
        "_value_tile_kernel", "_dqk_kernel"]
    # the output pass runs one program per (value tile, chunk, batch*head): all chunks at once
    assert launched[1][1] == (1, 2, 2)


def test_empty_sequence_returns_initial_state(lt):
    (q, k, v, h0), slope, _, _ = lightning_inputs(seq=0)
    out, final = lt.lightning_attn_triton(q, k, v, slope, h0, output_final_state=True)
    assert out.shape == (1, 2, 0, 24)
    torch.testing.assert_close(final, h0)


def test_rejects_bad_packing():
    q = torch.randn(2, 2, 6, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        lightning_attn_naive(q, q, q, torch.ones(2), cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="rise from 0 to T_total=6"):
        lightning_attn_chunk(q[:1], q[:1], q[:1], torch.ones(2), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


# ----------------------------------------------------------------- launch configurations


def test_every_launch_fits_hopper_shared_memory():
    """Every configuration lightning_launch can return, for head dims 16-512 (equal and
    unequal key/value dims), 16- and 32-bit inputs and every chunk size the model may ask
    for, stays under the 232,448 bytes a Hopper block may use, in every kernel."""
    for k_dim in (16, 32, 64, 96, 128, 256, 512):
        for v_dim in (k_dim, 64, 256):
            for element_bytes in (2, 4):
                for chunk in (4, 16, 32, 64, 128, 256):
                    launch = lightning_launch(k_dim, v_dim, element_bytes, chunk)
                    for kernel in KERNELS:
                        need = launch.shared_memory_bytes(kernel)
                        assert need <= HOPPER_SHARED_MEMORY_BYTES, (k_dim, v_dim, element_bytes, chunk, kernel, need)
    table = {(row["head_dim"], row["element_bytes"]): row for row in launch_table()}
    assert set(table) == {(d, b) for d in (32, 64, 128, 256) for b in (4, 2)}
    bf16_128 = table[(128, 2)]
    assert (bf16_128["BT"], bf16_128["BK"], bf16_128["BV"], bf16_128["num_stages"]) == (64, 64, 64, 3)
    assert bf16_128["smem_dqk"] == 131_072 and table[(256, 4)]["smem_dqk"] == 163_840


def test_shared_memory_estimate_reproduces_the_measured_failure():
    """The loads-times-stages term alone gives the 245,760 bytes the H200 reported for the
    sequence-walking kernel this replaced (q, k [64, 128] and v [64, 64] fp32 in its forward
    loop; q, k [64, 256] and v, do [64, 64] bf16 in its dk/dv loop; 3 stages)."""
    forward_d128_fp32 = estimate_shared_memory([(64, 128), (64, 128), (64, 64)], [], [], 4, 3, "tf32")
    dkdv_d256_bf16 = estimate_shared_memory([(64, 256), (64, 256), (64, 64), (64, 64)], [], [], 2, 3, None)
    assert forward_d128_fp32 == dkdv_d256_bf16 == 245_760 > HOPPER_SHARED_MEMORY_BYTES


def test_fp32_dots_are_explicitly_three_pass(lt, monkeypatch):
    """fp32 inputs launch every kernel with input_precision "tf32x3", 16-bit inputs with the
    default (which only fp32 operands read); the GPU would otherwise round fp32 to TF32."""
    assert lightning_launch(128, 128, 4).dot_precision == "tf32x3"
    assert lightning_launch(128, 128, 2).dot_precision is None
    launched = spy_launches(lt, monkeypatch, keep="DOT_PRECISION")
    inputs, slope, d_out, d_state = lightning_inputs(seq=20)
    run_lightning(lt.lightning_attn_triton, inputs, slope, d_out, d_state, chunk_size=16)
    assert len(launched) == 6 and {precision for _, precision in launched} == {"tf32x3"}


# ----------------------------------------------------------------- 64-bit offsets


@triton.jit
def _offsets_probe(out, cu_seqlens, chunk_offsets, i_n, i_h, T, NC, D, H: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Stores the element offsets of a sequence's first token row and first chunk state."""
    token_row, chunk_row, _ = lightning_triton._sequence_start(
        i_n, i_h, cu_seqlens, chunk_offsets, T, NC, H, IS_VARLEN)
    tl.store(out, token_row * D)
    tl.store(out + 1, chunk_row * D * D)


def test_offsets_are_64_bit_where_sizes_pass_2_31(lt):
    """Rows returned by _sequence_start are int64, so the element offsets the kernels form
    from them (row * head dim, state row * K * V) stay exact past 2**31: here batch 8,
    16 heads, 2**21 tokens, head dim 128, about 3.4e10 elements."""
    probe = _offsets_probe
    heads, seq_len, dim = 16, 2**21, 128
    n_chunks = seq_len // 64
    out = torch.zeros(2, dtype=torch.int64)
    probe[(1,)](out, None, None, 7, 15, seq_len, n_chunks, dim, heads, False)
    row = 7 * heads + 15
    assert out.tolist() == [row * seq_len * dim, row * n_chunks * dim * dim]
    assert out[0] > 2**31
    # packed: one sequence starting 2**21 - 5 tokens into a 2**21-token pack, last head
    cu_seqlens = torch.tensor([0, seq_len - 5, seq_len], dtype=torch.int32)
    chunk_offsets = torch.tensor([0, n_chunks, n_chunks + 1], dtype=torch.int32)
    probe[(1,)](out, cu_seqlens, chunk_offsets, 1, 15, seq_len, n_chunks + 1, dim, heads, True)
    assert out.tolist() == [(15 * seq_len + seq_len - 5) * dim, (15 * (n_chunks + 1) + n_chunks) * dim * dim]
