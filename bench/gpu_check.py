"""GPU check for issue #13: the Triton kernels and the hybrid model, each beside its peer, in
one command, ending in a summary table of every figure against its target.

    python bench/gpu_check.py                                # everything (~5 min on an H200)
    SECTIONS=lightning_speed,head_speed python bench/gpu_check.py
    SMALL=1 python bench/gpu_check.py                        # CPU dry run: tiny shapes, interpreter

Sections:
  launch              which head dims (32-256) x dtypes (fp32, bf16) launch fwd+bwd, with
                      each kernel's shared-memory estimate (kernels/launch_config.py)
  lightning_accuracy  o, final state, dq, dk, dv, dh0 vs the naive form (fp32 inputs; bf16
                      inputs against the naive form on the same bf16 values), packed sequences
  lightning_speed     fwd and fwd+bwd ms, bf16, B=1 H=16 D=128, 4K/16K/64K tokens, vs fla
                      chunk_simple_gla (same decay via g_gamma) and SDPA flash; SWEEP=1 also
                      times other tilings at 16K
  head_accuracy       FP32 log-prob head vs float64 at V=151,936: max |d logp|, entropy and
                      gradient errors; Triton (tf32x3), fused torch, and Triton with plain
                      TF32 dots as the control
  head_speed          fwd+bwd ms and peak GiB at 16K tokens, D=4096: naive full logits, fused
                      torch, Triton, Liger fused linear cross-entropy (bf16, CE only)
  model               hybrid train step tokens/s and peak GiB at 4K/16K/32K/64K vs a Llama of
                      the same sizes (SDPA); the loss falls over 8 AdamW steps

Peers are imported only if installed; a missing one leaves its column empty with the reason.
JSON lines go to $OUT/gpu.jsonl when OUT is set. Without CUDA (and without SMALL=1) nothing is
measured and the script exits 0. BUDGET_S (default 420) skips what would start after it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

SMALL = os.environ.get("SMALL") == "1"
if SMALL:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported anywhere

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
T0 = time.time()
BUDGET_S = float(os.environ.get("BUDGET_S", "420"))


# --------------------------------------------------------------------------- recording


class Report:
    """Prints every record as a JSON line (and appends it to $OUT/gpu.jsonl), and keeps the
    rows of the closing summary: (figure, ours, peer, ours vs peer, target, met)."""

    def __init__(self):
        out = os.environ.get("OUT")
        self.path = Path(out) / "gpu.jsonl" if out else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[tuple[str, str, str, str, str, str]] = []

    def record(self, **fields) -> None:
        fields["t"] = round(time.time() - T0, 1)
        line = json.dumps(fields, default=str)
        print(line, flush=True)
        if self.path:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def figure(self, name, ours, peer="", ratio="", target="", met=None, timing=False) -> None:
        """``timing``: a speed or memory figure, judged only on a GPU run at full size."""
        if timing and SMALL:
            met, target = None, f"{target} (dry run: not judged)"
        mark = "" if met is None else ("met" if met else "NOT MET")
        self.rows.append((name, _fmt(ours), _fmt(peer), _fmt(ratio), target, mark))

    def summary(self) -> None:
        header = ("figure", "ours", "peer", "ours vs peer", "target", "")
        widths = [max(len(str(r[i])) for r in [header, *self.rows]) for i in range(6)]
        print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
        print("-+-".join("-" * w for w in widths))
        for row in self.rows:
            print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)


REPORT = Report()


def run_section(fn) -> None:
    """Run a section unless past the budget; record a failure and go on."""
    if time.time() - T0 > BUDGET_S:
        REPORT.record(section=fn.__name__, skipped="time budget")
        return
    REPORT.record(section=fn.__name__, start=True)
    try:
        fn()
    except Exception as error:  # noqa: BLE001  one broken section must not hide the others' figures
        REPORT.record(section=fn.__name__, error=f"{type(error).__name__}: {error}", tb=traceback.format_exc()[-1500:])
        REPORT.figure(fn.__name__, f"error: {type(error).__name__}")
    finally:
        if DEV == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- measuring


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def ms_per_call(fn, warmup: int = 2, iters: int = 5) -> float:
    if SMALL:
        warmup, iters = 0, 1
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1000


def peak_gib(fn) -> float | None:
    """Peak memory allocated by ``fn`` above what was allocated before it (None on CPU)."""
    if DEV != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fwd_bwd(forward, leaves):
    def run():
        for x in leaves:
            x.grad = None
        out = forward()
        out.backward(torch.ones_like(out))
    return run


def slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * h / heads) for h in range(1, heads + 1)], device=DEV)


def ratio(peer, ours):
    return peer / ours if isinstance(peer, float) and isinstance(ours, float) and ours > 0 else None


def optional_peer(name: str, load):
    """A peer's entry point, or None with the reason recorded."""
    try:
        return load()
    except Exception as error:  # noqa: BLE001  any import failure means: column skipped
        REPORT.record(peer=name, skipped=f"{type(error).__name__}: {str(error)[:200]}")
        return None


# --------------------------------------------------------------------------- lightning


def lightning_case(batch, heads, seq_len, dim, seed=0, cu_seqlens=None):
    """Model-like inputs (silu(q, k, v) / 2), an initial state, upstream gradients."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n_states = cu_seqlens.numel() - 1 if cu_seqlens is not None else batch
    qkv = [F.silu(torch.randn(batch, heads, seq_len, dim, device=DEV, generator=gen)) * 0.5 for _ in range(3)]
    h0 = torch.randn(n_states, heads, dim, dim, device=DEV, generator=gen) * 0.1
    d_out = torch.randn(batch, heads, seq_len, dim, device=DEV, generator=gen)
    d_state = torch.randn(n_states, heads, dim, dim, device=DEV, generator=gen) * 0.1
    return qkv, h0, d_out, d_state


def lightning_grads(attn, qkv, h0, d_out, d_state, dtype, **kw):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in qkv)
    state = h0.detach().clone().requires_grad_()
    out, final = attn(q, k, v, slopes(q.shape[1]), state, True, **kw)
    ((out.float() * d_out).sum() + (final * d_state).sum()).backward()
    return {"o": out, "state": final, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dh0": state.grad}


def launch():
    from kernels.launch_config import HOPPER_SHARED_MEMORY_BYTES, KERNELS, lightning_launch
    from kernels.lightning_triton import lightning_attn_triton

    dims, seq_len = ((16, 32), 40) if SMALL else ((32, 64, 128, 256), 512)
    for dim in dims:
        for dtype in (torch.float32, torch.bfloat16):
            config = lightning_launch(dim, dim, torch.tensor([], dtype=dtype).element_size())
            smem = {name: config.shared_memory_bytes(name) for name in KERNELS}
            qkv, h0, d_out, d_state = lightning_case(1, 2, seq_len, dim)
            try:
                lightning_grads(lightning_attn_triton, qkv, h0, d_out, d_state, dtype)
                sync()
                ok, error = True, None
            except Exception as e:  # noqa: BLE001  a failed launch is the finding
                ok, error = False, f"{type(e).__name__}: {str(e)[:200]}"
            REPORT.record(check="lightning_launch", D=dim, dtype=str(dtype), ok=ok, error=error,
                          tiles=[config.block_t, config.block_k, config.block_v, config.num_stages], smem_estimate=smem)
            REPORT.figure(f"lightning launch D={dim} {str(dtype)[6:]}", "ok" if ok else "FAILED",
                          target=f"launches (est. {max(smem.values()):,} <= {HOPPER_SHARED_MEMORY_BYTES:,} B)", met=ok)


def lightning_accuracy():
    from kernels.lightning_naive import lightning_attn_naive
    from kernels.lightning_triton import lightning_attn_triton

    shapes = [(1, 2, 150, 32)] if SMALL else [(2, 4, 777, 64), (1, 8, 4096, 128)]
    for batch, heads, seq_len, dim in shapes:
        qkv, h0, d_out, d_state = lightning_case(batch, heads, seq_len, dim)
        for dtype, target in ((torch.float32, 1e-4), (torch.bfloat16, 3e-3)):
            ours = lightning_grads(lightning_attn_triton, qkv, h0, d_out, d_state, dtype)
            # the reference sees what the kernel saw: the inputs and upstream gradient in dtype
            same_values = [x.to(dtype).float() for x in qkv]
            ref = lightning_grads(lightning_attn_naive, same_values, h0, d_out.to(dtype).float(), d_state, torch.float32)
            errors = {key: relative_error(ours[key], ref[key]) for key in ref}
            # what rounding the exact result to the output dtype alone costs
            floor = {key: relative_error(ref[key].to(dtype), ref[key]) for key in ("o", "dq")}
            REPORT.record(check="lightning_vs_naive", shape=[batch, heads, seq_len, dim], dtype=str(dtype),
                          rel_err=errors, output_rounding_floor=floor if dtype != torch.float32 else None,
                          finite=all(bool(torch.isfinite(x.float()).all()) for x in ours.values()))
            worst = max(errors.values())
            if dtype == torch.bfloat16 and INTERPRETED:
                REPORT.figure(f"lightning rel err bf16 {[batch, heads, seq_len, dim]}", worst,
                              target="(interpreter: bf16 dots are not emulated, see tests)")
                continue
            REPORT.figure(f"lightning rel err {str(dtype)[6:]} {[batch, heads, seq_len, dim]}", worst,
                          target=f"<= {target:.0e}", met=worst <= target)
    # packed sequences: an empty one, ragged ones, one exactly a chunk
    lengths = [5, 0, 37, 16] if SMALL else [1000, 0, 1999, 64, 1033]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    qkv, h0, d_out, d_state = lightning_case(1, 4, int(cu_seqlens[-1]), 32 if SMALL else 128, cu_seqlens=cu_seqlens)
    ours = lightning_grads(lightning_attn_triton, qkv, h0, d_out, d_state, torch.float32, cu_seqlens=cu_seqlens)
    ref = lightning_grads(lightning_attn_naive, qkv, h0, d_out, d_state, torch.float32, cu_seqlens=cu_seqlens)
    errors = {key: relative_error(ours[key], ref[key]) for key in ref}
    REPORT.record(check="lightning_varlen_vs_naive", lengths=lengths, rel_err=errors)
    REPORT.figure("lightning rel err fp32 packed (cu_seqlens)", max(errors.values()), target="<= 1e-04",
                  met=max(errors.values()) <= 1e-4)


SWEEP_TILES = ((64, 64, 64, 4, 2), (64, 128, 64, 8, 2), (64, 64, 128, 8, 2), (32, 64, 64, 4, 3), (64, 32, 32, 4, 3))


def lightning_speed():
    chunk_simple_gla = optional_peer("fla", lambda: __import__("fla.ops.simple_gla", fromlist=["x"]).chunk_simple_gla)
    batch, heads, dim = (1, 2, 16) if SMALL else (1, 16, 128)
    lengths = (64, 128) if SMALL else (4096, 16384, 65536)
    for seq_len in lengths:
        if time.time() - T0 > BUDGET_S:
            REPORT.record(skipped=f"lightning_speed T={seq_len}: time budget")
            break
        ms = _time_lightning(batch, heads, seq_len, dim, chunk_simple_gla,
                             sweep=os.environ.get("SWEEP") == "1" and seq_len == (lengths[-1] if SMALL else 16384))
        tag = f"{seq_len // 1024}K" if seq_len >= 1024 else str(seq_len)
        fla_vs = ratio(ms.get("fla_fwd"), ms["ours_fwd"])
        REPORT.figure(f"lightning fwd ms {tag} (peer fla)", ms["ours_fwd"], ms.get("fla_fwd"), fla_vs,
                      ">= 1x at 16K, 64K", None if fla_vs is None or seq_len < 16384 else fla_vs >= 1, timing=True)
        sdpa_vs = ratio(ms["sdpa_flash_fwd_bwd"], ms["ours_fwd_bwd"])
        need = 4.0 if seq_len >= 65536 else 1.0
        REPORT.figure(f"lightning fwd+bwd ms {tag} (peer SDPA flash)", ms["ours_fwd_bwd"], ms["sdpa_flash_fwd_bwd"],
                      sdpa_vs, ">= 1x at 16K, >= 4x at 64K", None if sdpa_vs is None or seq_len < 16384 else sdpa_vs >= need,
                      timing=True)


def _time_lightning(batch, heads, seq_len, dim, chunk_simple_gla, sweep: bool) -> dict:
    """ms per call of ours, SDPA flash and fla (if given), fwd and fwd+bwd, bf16."""
    from kernels.launch_config import KERNELS, LightningLaunch
    from kernels.lightning_triton import lightning_attn_triton

    s = slopes(heads)
    q, k, v = (torch.randn(batch, heads, seq_len, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def ours(launch=None):
        return lightning_attn_triton(q, k, v, s, launch=launch)[0]

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = {"ours_fwd": ours, "ours_fwd_bwd": fwd_bwd(ours, (q, k, v)),
             "sdpa_flash_fwd": sdpa, "sdpa_flash_fwd_bwd": fwd_bwd(sdpa, (q, k, v))}
    if chunk_simple_gla is not None:
        # fla's layout is [B, T, H, D]; a constant per-head log decay g_gamma = -slope is ours
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def fla():
            return chunk_simple_gla(qt, kt, vt, g_gamma=-s.float(), scale=1.0)[0]
        cases["fla_fwd"] = fla
        cases["fla_fwd_bwd"] = fwd_bwd(fla, (qt, kt, vt))
    ms = {}
    for name, fn in cases.items():
        try:
            ms[name] = ms_per_call(fn)
        except Exception as e:  # noqa: BLE001  fla's backward refuses some Triton versions on Hopper
            ms[name] = None
            REPORT.record(bench="lightning_ms", T=seq_len, impl=name, error=f"{type(e).__name__}: {str(e)[:200]}")
    REPORT.record(bench="lightning_ms", B=batch, H=heads, D=dim, T=seq_len, ms=ms,
                  ours_fwd_bwd_peak_gib=peak_gib(cases["ours_fwd_bwd"]))
    for tiles in SWEEP_TILES if sweep else ():
        config = LightningLaunch(*tiles, element_bytes=2)
        try:
            swept = {"fwd": ms_per_call(lambda config=config: ours(config)),
                     "fwd_bwd": ms_per_call(fwd_bwd(lambda config=config: ours(config), (q, k, v)))}
        except Exception as e:  # noqa: BLE001  a tiling that fails to launch is a finding
            swept = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        REPORT.record(bench="lightning_tiles_sweep", T=seq_len, tiles=tiles, ms=swept,
                      smem_estimate=max(config.shared_memory_bytes(name) for name in KERNELS))
    return ms


# --------------------------------------------------------------------------- FP32 head


def head_reference(h, w, labels, g_logp, g_ent):
    """float64 full logits: log p(label), entropy and both gradients."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    log_probs = torch.log_softmax(h64 @ w64.T, -1)
    valid = labels != -100
    logp = torch.where(valid, log_probs.gather(-1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "dh": h64.grad, "dw": w64.grad}


def head_accuracy():
    from kernels.launch_config import head_launch
    from kernels.logprob_fused import token_logprobs_fused
    from kernels.logprob_triton import token_logprobs_triton

    rows, dim, vocab = (40, 32, 300) if SMALL else (2048, 1024, 151_936)
    gen = torch.Generator(device=DEV).manual_seed(1)
    h = torch.randn(rows, dim, device=DEV, generator=gen)
    w = torch.randn(vocab, dim, device=DEV, generator=gen) * (3.0 / math.sqrt(dim))
    labels = torch.randint(0, vocab, (rows,), device=DEV, generator=gen)
    labels[::7] = -100
    g_logp = torch.randn(rows, device=DEV, generator=gen)
    g_ent = torch.randn(rows, device=DEV, generator=gen) * 0.1
    ref = head_reference(h, w, labels, g_logp, g_ent)
    tf32_control = dataclasses.replace(head_launch(rows, vocab, dim), dot_precision="tf32")
    impls = {"triton_tf32x3": token_logprobs_triton, "fused_torch": token_logprobs_fused,
             "triton_tf32_control": lambda *a: token_logprobs_triton(*a, launch=tf32_control)}
    for name, fn in impls.items():
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, entropy = fn(hh, ww, labels, -100)
        ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
        logp, entropy = logp.detach(), entropy.detach()
        max_abs = float((logp.double() - ref["logp"]).abs().max())
        valid = labels != -100
        REPORT.record(check="head_vs_fp64", impl=name, N=rows, D=dim, V=vocab, max_abs_logp_err=max_abs,
                      mean_abs_ratio_err=float(((logp.double() - ref["logp"]).exp() - 1).abs()[valid].mean()),
                      rel_err={"entropy": relative_error(entropy, ref["entropy"]), "dh": relative_error(hh.grad, ref["dh"]),
                               "dw": relative_error(ww.grad, ref["dw"])})
        met = max_abs <= 1e-4 if name != "triton_tf32_control" else None
        REPORT.figure(f"head max |d logp| vs fp64, {name}", max_abs, target="<= 1e-04" if met is not None else "(control)",
                      met=met)


def head_speed():
    from kernels.logprob_fused import token_logprobs_fused
    from kernels.logprob_naive import token_logprobs_naive
    from kernels.logprob_triton import token_logprobs_triton

    liger_loss = optional_peer("liger", lambda: __import__(
        "liger_kernel.transformers.fused_linear_cross_entropy", fromlist=["x"]).LigerFusedLinearCrossEntropyLoss)
    rows, dim, vocab = (64, 32, 500) if SMALL else (16384, 4096, 151_936)
    gen = torch.Generator(device=DEV).manual_seed(2)
    h = torch.randn(rows, dim, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, dim, device=DEV, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=DEV, generator=gen)

    def step(fn, weight):
        def run():
            h.grad = weight.grad = None
            logp, entropy = fn(h, weight, labels, -100)
            (logp.sum() + entropy.sum()).backward()
        return run

    results = {}
    for name, fn in (("naive", token_logprobs_naive), ("fused_torch", token_logprobs_fused),
                     ("triton", token_logprobs_triton)):
        try:
            results[name] = (ms_per_call(step(fn, w), warmup=1, iters=3), peak_gib(step(fn, w)))
        except torch.OutOfMemoryError:
            results[name] = ("OOM", None)
        h.grad = w.grad = None
    if liger_loss is not None:
        w16 = w.detach().to(torch.bfloat16).requires_grad_()
        loss_fn = liger_loss()

        def liger():
            h.grad = w16.grad = None
            loss_fn(w16, h, labels).backward()
        results["liger_bf16_ce"] = (ms_per_call(liger, warmup=1, iters=3), peak_gib(liger))
    REPORT.record(bench="head_fwd_bwd", N=rows, D=dim, V=vocab, ms_and_peak_gib=results,
                  note="fp32 weight, bf16 hidden; liger: bf16 weight, cross-entropy only")
    ours_ms, ours_gib = results["triton"]
    naive_ms = results["naive"][0]
    speedup = ratio(naive_ms, ours_ms)
    REPORT.figure(f"head fwd+bwd ms {rows}x{dim} V={vocab} (peer naive fp32)", ours_ms, naive_ms, speedup, ">= 2x",
                  None if speedup is None else speedup >= 2, timing=True)
    REPORT.figure("head peak GiB (peer naive fp32)", ours_gib, results["naive"][1], "", "<= 1 GiB",
                  None if ours_gib is None else ours_gib <= 1.0, timing=True)
    if "liger_bf16_ce" in results:
        REPORT.figure("head fwd+bwd ms (peer Liger bf16 CE)", ours_ms, results["liger_bf16_ce"][0],
                      ratio(results["liger_bf16_ce"][0], ours_ms), "(reference)", timing=True)


# --------------------------------------------------------------------------- model


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import HybridConfig
    from model.hybrid import HybridForCausalLM

    sizes = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 131072}
    if SMALL:
        sizes.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=500)
    dtype = torch.bfloat16
    hybrid = HybridForCausalLM(HybridConfig(**sizes, lightning_chunk_size=64)).to(DEV, dtype)
    hybrid.lm_head.float()  # the FP32 head, as _keep_in_fp32_modules keeps it when loading
    llama = LlamaForCausalLM(LlamaConfig(**sizes, attn_implementation="sdpa")).to(DEV, dtype)
    REPORT.record(info="model_params", hybrid=sum(p.numel() for p in hybrid.parameters()),
                  llama=sum(p.numel() for p in llama.parameters()), hybrid_layers=hybrid.config.layer_types)

    torch.manual_seed(0)
    ids = torch.randint(0, sizes["vocab_size"], (2, 64 if SMALL else 2048), device=DEV)
    optimizer = torch.optim.AdamW(hybrid.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-15)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = hybrid(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(round(float(loss), 4))
    del optimizer
    REPORT.record(check="hybrid_loss_falls", losses=losses)
    REPORT.figure("hybrid loss over 8 steps", f"{losses[0]} -> {losses[-1]}", target="falls",
                  met=losses[-1] < losses[0] and all(math.isfinite(x) for x in losses))

    for seq_len in ((64, 128) if SMALL else (4096, 16384, 32768, 65536)):
        step = {}
        for name, net in (("hybrid", hybrid), ("llama", llama)):
            if time.time() - T0 > BUDGET_S:
                REPORT.record(skipped=f"model T={seq_len} {name}: time budget")
                continue
            x = torch.randint(0, sizes["vocab_size"], (1, seq_len), device=DEV)

            def train_step(net=net, x=x):
                net.zero_grad(set_to_none=True)
                net(x, labels=x).loss.backward()
            try:
                ms = ms_per_call(train_step, warmup=1, iters=2)
                step[name] = (seq_len / ms * 1000, peak_gib(train_step))
            except torch.OutOfMemoryError as e:
                step[name] = ("OOM", None)
                REPORT.record(bench="model_train_step", model=name, T=seq_len, error="OOM", detail=str(e)[:200])
            net.zero_grad(set_to_none=True)
            if DEV == "cuda":
                torch.cuda.empty_cache()
        REPORT.record(bench="model_train_step", T=seq_len, tokens_per_s_and_peak_gib=step)
        if len(step) == 2:
            (ours, ours_gib), (peer, peer_gib) = step["hybrid"], step["llama"]
            speedup = ratio(ours, peer)  # tokens/s: ours over the peer's
            need = 2.0 if seq_len >= 65536 else 1.0
            tag = f"{seq_len // 1024}K" if seq_len >= 1024 else str(seq_len)
            REPORT.figure(f"train step tokens/s {tag} (peer Llama SDPA)", ours, peer, speedup,
                          ">= 1x at 16K, >= 2x at 64K", None if speedup is None or seq_len < 16384 else speedup >= need,
                          timing=True)
            if ours_gib is not None and isinstance(peer_gib, float):
                REPORT.figure(f"train step peak GiB {tag}", ours_gib, peer_gib, "", "<= Llama's", ours_gib <= peer_gib,
                              timing=True)


SECTIONS = {fn.__name__: fn for fn in (launch, lightning_accuracy, lightning_speed, head_accuracy, head_speed, model)}


def main() -> int:
    wanted = os.environ.get("SECTIONS", ",".join(SECTIONS)).split(",")
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        print(f"bench/gpu_check.py: unknown SECTIONS {unknown}; choose from {list(SECTIONS)}")
        return 2
    if DEV != "cuda" and not SMALL:
        print("bench/gpu_check.py: no CUDA: nothing measured (SMALL=1 runs a CPU dry run of the script "
              "at tiny shapes under the Triton interpreter).")
        return 0
    REPORT.record(info="env", torch=torch.__version__, device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                  small=SMALL, triton_interpret=os.environ.get("TRITON_INTERPRET"))
    for name in wanted:
        run_section(SECTIONS[name])
    REPORT.record(done=True, total_s=round(time.time() - T0, 1))
    REPORT.summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
