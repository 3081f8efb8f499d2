"""Launch configurations of the Triton kernels (chunk-parallel lightning attention, the FP32
log-prob head), and what each one asks of shared memory.

A Triton kernel that needs more shared memory than the GPU has per block fails at launch,
not at compile time, and the CPU interpreter never notices (on an H200 the sequence-walking
kernel this replaced failed for head dim 128 in fp32 and 256 in fp32 and bf16: 245,760 >
232,448 bytes). So the tiles are chosen here, per head dim and element size, and
``shared_memory_bytes`` estimates each kernel's need from the tiles it keeps on chip, so that
a CPU test can hold every configuration under Hopper's limit.

The estimate counts, per kernel:
  - every tile loaded inside its main loop, times ``num_stages`` (the software pipeline keeps
    that many copies in flight); this term alone reproduces the measured 245,760 bytes;
  - every other dot operand once (tiles loaded after the loop, and operands computed in
    registers such as the decayed keys or the masked score matrix);
  - for fp32 tiles, whose dots run as "tf32x3" (a TF32 high part and a TF32 residual per
    operand, three tensor-core passes), a high and a low copy of every right-hand operand.
It is deliberately on the safe side: Triton may reuse buffers whose lifetimes do not overlap.

Imports neither torch nor Triton, so configurations can be inspected anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

HOPPER_SHARED_MEMORY_BYTES = 232_448  # per block, 227 KiB (H100 / H200)
KERNELS = ("state_scan", "value_tile", "dqk")
HEAD_KERNELS = ("logits", "matmul")

# tl.dot's input_precision for fp32 tiles: never the silent TF32 default (~1e-3 relative).
FP32_DOT_PRECISION = "tf32x3"

_MAX_CHUNK = 64  # BT: the intra-chunk work is BT x BT per chunk; 64 is what fla uses on Hopper


@dataclass(frozen=True)
class LightningLaunch:
    """Tiles and pipeline depth shared by the three kernels of one call.

    block_t is the chunk length (tokens per chunk), block_k / block_v the key / value tiles;
    a program owns one value tile (output, dv), one key tile (dqk) or one key x value tile of
    the state (the two scans), and loops over the other dimension in tiles of the same size.
    """

    block_t: int
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int
    element_bytes: int  # of q, k, v (and of the per-chunk states, stored in the input dtype)

    @property
    def dot_precision(self) -> str | None:
        """input_precision for tl.dot: only fp32 operands read it (bf16/fp16 are exact products)."""
        return FP32_DOT_PRECISION if self.element_bytes == 4 else None

    def kernel_tiles(self, kernel: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(tiles loaded in the main loop, other dot operands, right-hand dot operands) of a kernel."""
        bt, bk, bv = self.block_t, self.block_k, self.block_v
        if kernel == "state_scan":  # loop over chunks: state += (k * decay)^T v (reversed: q, do)
            return [(bt, bk), (bt, bv)], [(bt, bk)], [(bt, bv)]
        if kernel == "value_tile":  # loop over key tiles: q k^T and q S (for dv: k q^T and k dS)
            return ([(bt, bk), (bt, bk), (bk, bv)], [(bt, bv), (bt, bt)],
                    [(bk, bt), (bk, bv), (bt, bv)])
        if kernel == "dqk":  # loop over value tiles: do v^T, do h^T, v dh^T; then dP k, dP^T q
            return ([(bt, bv), (bt, bv), (bk, bv), (bk, bv)], [(bt, bk), (bt, bk), (bt, bt), (bt, bt)],
                    [(bv, bt), (bv, bk), (bv, bk), (bt, bk), (bt, bk)])
        raise ValueError(f"unknown lightning kernel {kernel!r}; expected one of {KERNELS}")

    def shared_memory_bytes(self, kernel: str) -> int:
        pipelined, once, rhs = self.kernel_tiles(kernel)
        return estimate_shared_memory(pipelined, once, rhs, self.element_bytes, self.num_stages,
                                      self.dot_precision)


def estimate_shared_memory(pipelined, once, rhs_operands, element_bytes: int, num_stages: int,
                           dot_precision: str | None) -> int:
    """Bytes of shared memory for tiles given as (rows, cols): see the module docstring."""

    def area(tiles) -> int:
        return sum(rows * cols for rows, cols in tiles)

    total = area(pipelined) * num_stages + area(once)
    if dot_precision == "tf32x3":
        total += 2 * area(rhs_operands)
    return total * element_bytes


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def lightning_launch(k_dim: int, v_dim: int, element_bytes: int, chunk_size: int = 64) -> LightningLaunch:
    """The configuration for head dims (k_dim, v_dim) and inputs of ``element_bytes``.

    Key and value tiles are capped (64 for 16-bit inputs, 32 for fp32, whose 3-pass dots hold
    each right-hand operand twice more), so a larger head dim adds loop iterations or programs,
    never shared memory: 32 through 256 (and beyond) launch with the same per-block footprint.
    ``chunk_size`` is rounded up to a power of two in [16, 64] (16 is tl.dot's smallest tile).
    """
    cap = 64 if element_bytes <= 2 else 32
    block_t = min(_MAX_CHUNK, max(16, _next_power_of_2(chunk_size)))
    return LightningLaunch(
        block_t=block_t,
        block_k=min(cap, max(16, _next_power_of_2(k_dim))),
        block_v=min(cap, max(16, _next_power_of_2(v_dim))),
        num_warps=4,
        num_stages=3 if element_bytes <= 2 else 2,
        element_bytes=element_bytes,
    )


def launch_table(head_dims=(32, 64, 128, 256), element_sizes=(4, 2), chunk_size: int = 64) -> list[dict]:
    """One row per (head dim, element size): tiles and every kernel's shared-memory estimate."""
    rows = []
    for dim in head_dims:
        for size in element_sizes:
            launch = lightning_launch(dim, dim, size, chunk_size)
            rows.append({"head_dim": dim, "element_bytes": size, "BT": launch.block_t, "BK": launch.block_k,
                         "BV": launch.block_v, "num_warps": launch.num_warps, "num_stages": launch.num_stages,
                         "dot_precision": launch.dot_precision,
                         **{f"smem_{name}": launch.shared_memory_bytes(name) for name in KERNELS}})
    return rows


# --------------------------------------------------------------------------- FP32 log-prob head

GRAD_CHUNK_BYTES = 512 * 2**20  # the backward's dL/dlogits buffer for one chunk of rows


@dataclass(frozen=True)
class HeadLaunch:
    """Tiles of the FP32 head: the logit kernels (forward and dL/dlogits) own block_rows x
    block_vocab logits and loop over the feature dim in block_dim steps; the backward's
    matmuls own block_mn x block_mn outputs and loop in block_mk steps. ``row_chunk`` rows
    have their dL/dlogits materialized at a time (fp32, row_chunk x vocab)."""

    block_rows: int
    block_vocab: int
    block_dim: int
    block_mn: int
    block_mk: int
    row_chunk: int
    num_warps: int = 8
    num_stages: int = 3
    dot_precision: str = FP32_DOT_PRECISION

    def kernel_tiles(self, kernel: str):
        if kernel == "logits":  # h [rows, d] and w [vocab, d] tiles per step; w^T is the right operand
            return [(self.block_rows, self.block_dim), (self.block_vocab, self.block_dim)], [], \
                [(self.block_dim, self.block_vocab)]
        if kernel == "matmul":
            return [(self.block_mn, self.block_mk), (self.block_mk, self.block_mn)], [], \
                [(self.block_mk, self.block_mn)]
        raise ValueError(f"unknown head kernel {kernel!r}; expected one of {HEAD_KERNELS}")

    def shared_memory_bytes(self, kernel: str) -> int:
        pipelined, once, rhs = self.kernel_tiles(kernel)
        return estimate_shared_memory(pipelined, once, rhs, 4, self.num_stages, self.dot_precision)


def head_launch(n_rows: int, vocab: int, dim: int) -> HeadLaunch:
    """GPU tiles, shrunk (never below tl.dot's 16) for small problems; the row chunk keeps the
    dL/dlogits buffer under GRAD_CHUNK_BYTES (768 rows at a 151,936 vocabulary)."""

    def fit(cap: int, n: int) -> int:
        return min(cap, max(16, _next_power_of_2(n)))

    block_mn = fit(128, max(n_rows, dim))
    rows_in_budget = max(block_mn, GRAD_CHUNK_BYTES // (4 * vocab) // block_mn * block_mn)
    return HeadLaunch(block_rows=fit(64, n_rows), block_vocab=fit(128, vocab), block_dim=fit(32, dim),
                      block_mn=block_mn, block_mk=32, row_chunk=min(rows_in_budget, max(n_rows, 1)))
