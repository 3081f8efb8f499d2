"""``kernels.utils.kernel_entry``, the prologue every kernel entry point shares: shape errors that
name the argument at every entry, positional and keyword calls bound alike, slopes brought to the
queries' device, contiguous inputs for the Triton entries (same values and gradients as from
contiguous ones), and packed sequences split into one call per sequence or handed on as int32
offsets. The Triton entries run under TRITON_INTERPRET=1, as in ``test_kernels``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from test_kernels import (
    assert_all_close,
    interpreted_module,
    lightning_inputs,
    logprob_inputs,
    run_lightning,
    run_logprob,
)

from kernels import (
    lightning_attn_chunk,
    lightning_attn_naive,
    lightning_attn_recurrent,
    token_logprobs_fused,
    token_logprobs_naive,
)
from kernels.utils import kernel_entry

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def triton_entries():
    return (interpreted_module("kernels.lightning_triton").lightning_attn_triton,
            interpreted_module("kernels.logprob_triton").token_logprobs_triton)


def recording_lightning(calls: list, **options):
    """A lightning entry that records what reached it and returns (q, final state of ones)."""

    @kernel_entry("lightning", **options)
    def entry(q, k, v, slope, initial_state=None, output_final_state=False, scale=1.0, cu_seqlens=None,
              chunk_size=64):
        calls.append({"q": q, "k": k, "v": v, "slope": slope, "initial_state": initial_state, "scale": scale,
                      "cu_seqlens": cu_seqlens, "chunk_size": chunk_size})
        if not output_final_state or q.shape[2] == 0:   # an empty sequence reports no state
            return q.clone(), None
        return q.clone(), torch.ones(q.shape[0], q.shape[1], q.shape[3], v.shape[3])

    return entry


# ----------------------------------------------------------------- errors name the argument


def lightning_entries(triton_entries):
    return [lightning_attn_naive, lightning_attn_recurrent, lightning_attn_chunk, triton_entries[0]]


def test_every_lightning_entry_names_the_argument_that_does_not_fit(triton_entries):
    q = torch.randn(1, 2, 6, 4)
    for entry in lightning_entries(triton_entries):
        with pytest.raises(ValueError, match=r"slope must have shape \[H=2\], got \(3,\)"):
            entry(q, q, q, torch.ones(3))
        with pytest.raises(ValueError, match=r"q, k \[B, H, T, K\].*k \(1, 2, 5, 4\)"):
            entry(q, q[:, :, :5], q, torch.ones(2))
        with pytest.raises(ValueError, match=r"batch size 1, got q \(2, 2, 6, 4\)"):
            entry(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), torch.ones(2),
                  cu_seqlens=torch.tensor([0, 6]))
        with pytest.raises(ValueError, match=r"cu_seqlens must be an int32 tensor.*got torch.float32"):
            entry(q, q, q, torch.ones(2), cu_seqlens=torch.tensor([0.0, 6.0]))
        with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T_total=6, got \[0, 4, 3\]"):
            entry(q, q, q, torch.ones(2), cu_seqlens=torch.tensor([0, 4, 3], dtype=torch.int32))
        with pytest.raises(ValueError, match=r"initial_state must hold one state per sequence \(2\)"):
            entry(q, q, q, torch.ones(2), torch.zeros(1, 2, 4, 4), cu_seqlens=torch.tensor([0, 2, 6]))


def test_every_head_entry_names_the_argument_that_does_not_fit(triton_entries):
    for entry in (token_logprobs_naive, token_logprobs_fused, triton_entries[1]):
        with pytest.raises(ValueError, match=r"hidden \(3, 4\) must be labels \(2,\) plus a feature dim"):
            entry(torch.randn(3, 4), torch.randn(10, 4), torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match=r"weight must be \[vocab, 4\], got \(10, 5\)"):
            entry(torch.randn(3, 4), torch.randn(10, 5), torch.zeros(3, dtype=torch.long))


def test_a_decorator_that_cannot_apply_is_refused():
    with pytest.raises(ValueError, match="unknown kernel family 'mlp'"):
        kernel_entry("mlp")
    with pytest.raises(ValueError, match="split_varlen applies to lightning"):
        kernel_entry("head", split_varlen=True)


# ----------------------------------------------------------------- arguments, device, contiguity


def test_keyword_and_positional_calls_are_guarded_alike():
    calls = []
    entry = recording_lightning(calls)
    q = torch.randn(1, 2, 6, 4)
    entry(q, q, q, torch.ones(2), None, False, 0.5)
    entry(v=q, k=q, q=q, slope=torch.ones(2), scale=0.5)
    assert [c["scale"] for c in calls] == [0.5, 0.5]
    with pytest.raises(ValueError, match="slope must have shape"):
        entry(slope=torch.ones(3), q=q, k=q, v=q)
    with pytest.raises(TypeError, match="'slope'"):
        entry(q, q, q)


def test_slope_follows_the_queries_device():
    calls = []
    q = torch.empty(1, 2, 6, 4, device="meta")
    recording_lightning(calls)(q, q, q, torch.ones(2))
    assert calls[0]["slope"].device.type == "meta"


def test_contiguous_entries_get_contiguous_tensors_and_others_get_them_untouched():
    q = torch.randn(1, 2, 4, 6).transpose(2, 3)     # [1, 2, 6, 4], not contiguous
    assert not q.is_contiguous()
    as_given, contiguous = [], []
    recording_lightning(as_given)(q, q, q, torch.ones(2))
    recording_lightning(contiguous, contiguous=True)(q, q, q, torch.ones(2))
    assert as_given[0]["q"] is q
    assert all(contiguous[0][name].is_contiguous() for name in ("q", "k", "v", "slope"))
    torch.testing.assert_close(contiguous[0]["q"], q, atol=0, rtol=0)


def test_triton_lightning_gives_transposed_inputs_the_values_and_gradients_of_contiguous_ones(triton_entries):
    (q, k, v, h0), slope, d_out, d_state = lightning_inputs(seq=20, k_dim=16, v_dim=16)
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v, h0)]
    assert not any(x.is_contiguous() for x in strided)

    def run(inputs):
        leaves = [x.detach().requires_grad_() for x in inputs]
        out, final = triton_entries[0](*leaves[:3], slope, leaves[3], output_final_state=True, chunk_size=16)
        ((out * d_out).sum() + (final * d_state).sum()).backward()
        return [out, final, *(x.grad for x in leaves)]

    got = run(strided)
    assert_all_close(got, run([q, k, v, h0]), atol=0, rtol=0)
    assert_all_close(got, run_lightning(lightning_attn_naive, (q, k, v, h0), slope, d_out, d_state))


def test_triton_head_gives_a_transposed_weight_the_values_and_gradients_of_a_contiguous_one(triton_entries):
    hidden, weight, labels, g_logp, g_ent = logprob_inputs(rows=(2, 5), dim=8, vocab=37)
    strided = weight.T.contiguous().T
    assert not strided.is_contiguous()
    got = run_logprob(triton_entries[1], hidden, strided, labels, g_logp, g_ent)
    ref = run_logprob(token_logprobs_naive, hidden, weight, labels, g_logp, g_ent)
    assert_all_close(got, ref)
    assert got[3].shape == weight.shape


# ----------------------------------------------------------------- packed sequences


def test_split_varlen_runs_each_sequence_alone_and_joins_the_results():
    calls = []
    entry = recording_lightning(calls, split_varlen=True)
    q = torch.arange(1 * 2 * 9 * 4, dtype=torch.float32).view(1, 2, 9, 4)
    h0 = torch.randn(3, 2, 4, 4)
    out, final = entry(q, q, q, torch.ones(2), h0, True, chunk_size=8,
                       cu_seqlens=torch.tensor([0, 5, 5, 9]))
    assert [c["q"].shape[2] for c in calls] == [5, 0, 4]
    assert all(c["cu_seqlens"] is None and c["chunk_size"] == 8 for c in calls)
    for n, c in enumerate(calls):
        torch.testing.assert_close(c["initial_state"], h0[n : n + 1])
    torch.testing.assert_close(out, q)                 # outputs joined back on the time axis
    torch.testing.assert_close(final[1], h0[1])        # the empty sequence keeps its initial state
    torch.testing.assert_close(final[[0, 2]], torch.ones(2, 2, 4, 4))
    assert entry(q, q, q, torch.ones(2), cu_seqlens=torch.tensor([0, 9]))[1] is None


def test_packed_entries_get_int32_offsets_on_the_queries_device():
    calls = []
    q = torch.randn(1, 2, 9, 4)
    recording_lightning(calls)(q, q, q, torch.ones(2), cu_seqlens=torch.tensor([0, 5, 9]))
    offsets = calls[0]["cu_seqlens"]
    assert offsets.dtype == torch.int32 and offsets.is_contiguous() and offsets.tolist() == [0, 5, 9]
    assert len(calls) == 1 and calls[0]["q"] is q


def test_packed_triton_and_split_references_agree(triton_entries):
    (q, k, v, _), slope, _, _ = lightning_inputs(seq=21, k_dim=16, v_dim=16)
    cu_seqlens = torch.tensor([0, 7, 7, 21])                  # int64, one empty sequence
    h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    packed = triton_entries[0](q, k, v, slope, h0, True, chunk_size=16, cu_seqlens=cu_seqlens)
    split = lightning_attn_chunk(q, k, v, slope, h0, True, chunk_size=16, cu_seqlens=cu_seqlens)
    assert_all_close(packed, split)
    torch.testing.assert_close(packed[1][1], h0[1])
