"""A decode layer's kernels: the engine's chain against Triton products that take the small
kernels between them in, against the layer's weights cut into parts on streams of their own,
and, with attention, against the batch split in two halves.

    python scripts/bench_layer_chain.py [--model random:llama-8b] [--rows 32] [--layers 32]
                                        [--context 0] [--kernels] [--match REGEX]
                                        [--json PATH]
    python scripts/bench_layer_chain.py --self-check

At a decode step's 32 rows every product is bound by its weight's bytes, and between them
the compiled layer runs five small kernels: the input RMSNorm, rotary, the residual add with
the second norm, SiLU-and-multiply, and the residual add at the layer's end (a kernel of its
own because each layer is its own graph). Each is a launch with a ramp and a tail, a few
microseconds where its bytes would take well under one. A product that streams its weight
can take most of them in:

* the input norm as a prologue and epilogue: the norm's weight folded into the product's
  weight once, at load; each row's 1/rms from the sum of squares of the row the program
  streams anyway; the program's outputs scaled by it at the end;
* the previous layer's residual add with it: the program adds the two inputs as it streams
  them, and each K tile of the sum (the next residual) is written by one program;
* o's residual add as an epilogue.

SiLU-and-multiply and down stay as they are: each of down's programs would read the whole
gate|up output.

Chains timed, each over ``--layers`` layers with weights of their own (past the L2, as a
model's are), replayed from a CUDA graph:

* ``engine``: the small kernels in Triton, one where inductor has one (the norm; an
  element-wise kernel in rotary's place; add and norm; SiLU-and-multiply; the boundary add),
  and cuBLASLt's products through ``F.linear``, as the worker calls them (down, the same in
  every chain, through ``torch.mm`` into a buffer the next layer reads);
* ``triton products``: the same with this script's products for q|k|v, o and gate|up, nothing
  fused: what the products alone cost against cuBLASLt's;
* ``fused``: q|k|v with the boundary add and the input norm, o with the residual add, gate|up
  with the norm; cuBLASLt's down;
* ``fused, cuBLASLt gate|up``: fused q|k|v and o, then the norm kernel and cuBLASLt's gate|up;
* ``persistent MLP, TILES``: the engine's chain with gate|up, SiLU-and-multiply and down as
  one kernel of one program an SM: the programs compute SiLU-and-multiply of their rows of
  gate|up into a scratch buffer, wait at a barrier across the grid, then each computes its
  rows of down. It asks what the fixed costs of two products and a small kernel between
  them come to when one launch streams both weights; ``MLP in two launches`` is the same
  code with the barrier replaced by a kernel boundary. Variants ask the L2 for down's first
  tiles before the barrier, and poll it with plain loads rather than atomics. (On an H100
  the barrier cost 1.8-2.8 us more than the boundary either way: docs/PERFORMANCE.md,
  session 41.)

With ``--context N`` each layer also runs the engine's decode attention (``paged_decode.py``)
over a paged cache of its own, every sequence at N tokens, and two more chains split the
batch in halves: ``engine, halves in turn`` (each layer on one half, then on the other: every
weight read twice) and ``engine, halves on two streams`` (the second half half a layer behind
the first, on a stream of its own). At a large batch of a small model the products sit near
the ridge of compute and bandwidth while attention is bound by the cache's bytes; the second
asks whether one half's attention beside the other's products buys back more than the
second weight read costs. ``--kernels`` prints each one-stream chain's kernels a layer as
the profiler sees one replay.

``engine, cut in P on P streams`` (P = 2, 4) splits the weights rather than the batch: each
part takes 1/P of the heads (its q|k|v rows, its attention, o's columns for them) and 1/P of
the intermediate rows (gate's and up's, down's columns), so every byte is still read once;
o's and down's partial products are summed where the parts join (with the second norm, and
with the boundary add). Each part runs on a stream of its own, so that one part's kernels can
take the SMs that another's ramp or tail leaves idle: a layer's excess over its bytes is
such fixed costs a kernel. ``engine, cut in 2 in turn`` runs the same kernels on one
stream, the cut's own cost. (On an H100 the streams took back most of the cut's cost but not
all: two parts 2.8% longer than the engine's chain at the 8B x32, 4.5% at the 1B x256;
docs/PERFORMANCE.md, session 50.) ``--match REGEX`` times only
the chains whose names match. ``--cache-layouts`` (with ``--context``) times the engine's
chain alone over three caches: as the engine lays it out (a slot's KV heads side by side, so
a program of two heads at head_dim 64 reads 256 bytes a key), the same with one head a
program, and head-major (each head's slots together: a block of 16 keys of one head is one
run of 2 KB at head_dim 64), through the same kernel by its strides.

The products tile the weight's rows across programs and keep the batch's rows whole and the
full depth in one loop (the weight is the operand that streams; the rows stay in L2).
``--self-check`` runs every kernel against torch at small sizes and exits: on a GPU if there
is one, else under Triton's CPU interpreter. Nothing in the engine uses these kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

_EPS = 1e-5
# (weight rows a program, depth a loop step, warps, stages): the best of a sweep at 32 rows
# on an H200 (docs/PERFORMANCE.md, session 24).
QKV_TILES = (64, 256, 4, 4)
O_TILES = (32, 256, 4, 4)
GATE_UP_TILES = (64, 128, 4, 4)
# q|k|v with the boundary add streams two input tiles beside the weight's: four stages of
# them pass the H200's 227 KiB of shared memory.
QKV_ADD_TILES = (64, 256, 4, 3)


class MlpTiles(NamedTuple):
    """The MLP kernel's tiles: gate and up's intermediate rows a program and depth a step,
    down's output rows a program and depth a step; warps, stages; down's tiles a program
    asks the L2 for before the barrier."""

    block_i: int
    block_k1: int
    block_n: int
    block_k2: int
    warps: int
    stages: int
    prefetch: int = 0
    poll_loads: bool = False  # the barrier's waiting programs poll with loads, not atomics


# At the 8B's 32 rows, 112 programs of 128 intermediate rows, then 128 of 32 output rows;
# the others as measured beside it (docs/PERFORMANCE.md, session 41: on an H100 the barrier
# polled with atomics cost 2.8 us more than the kernel boundary it replaces, prefetched
# tiles or not; polled with loads, see there).
MLP_BASE_TILES = MlpTiles(128, 64, 32, 256, 4, 4)
MLP_TILES = {
    "k64 x4": MLP_BASE_TILES,
    "k64 x4, 16 tiles prefetched": MLP_BASE_TILES._replace(prefetch=16),
    "k64 x4, polling loads": MLP_BASE_TILES._replace(poll_loads=True),
    "k64 x4, polling loads, 16 tiles prefetched": MLP_BASE_TILES._replace(
        prefetch=16, poll_loads=True
    ),
}
# The products hold all the batch's rows in one tile, beside the weight's: past this many,
# their tiles outgrow shared memory.
MAX_TRITON_ROWS = 64


# elementwise_kernel's operations.
ROTARY_PLACE, SILU_AND_MULTIPLY, ADD = 0, 1, 2


class _Kernels(NamedTuple):
    product: Any
    norm_product: Any
    rms_norm: Any
    elementwise: Any
    mlp: Any
    parts_sum: Any


@functools.cache
def _kernels() -> _Kernels:
    """The Triton kernels, built on first use (after --self-check may set TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    @triton.jit
    def product_kernel(
        x_ptr, w_ptr, res_ptr, out_ptr, rows,
        K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        """out = x @ w.T (+ res): a program per BLOCK_N weight rows, every batch row."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        row_ok = (rm < rows)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :])
            x = tl.load(x_ptr + rm[None, :] * K + (k + rk)[:, None], mask=row_ok, other=0.0)
            acc = tl.dot(w, x, acc)
        out = out_ptr + rm[None, :] * N + rn[:, None]
        y = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:  # rounded as eager rounds the product before the add
            res = tl.load(res_ptr + rm[None, :] * N + rn[:, None], mask=row_ok, other=0.0)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out, y, mask=row_ok)

    @triton.jit
    def norm_product_kernel(
        a_ptr, b_ptr, sum_ptr, w_ptr, out_ptr, rows, eps,
        K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        """out = rmsnorm(a (+ b)) @ w.T, the norm's weight already folded into w; with ADD the
        sum a + b is also written to sum_ptr, each K tile by one program."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        row_ok = (rm < rows)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for tile in range(0, K // BLOCK_K):
            offsets = rm[None, :] * K + (tile * BLOCK_K + rk)[:, None]
            w = tl.load(w_ptr + rn[:, None] * K + (tile * BLOCK_K + rk)[None, :])
            x = tl.load(a_ptr + offsets, mask=row_ok, other=0.0)
            if ADD:
                b = tl.load(b_ptr + offsets, mask=row_ok, other=0.0)
                x = (x.to(tl.float32) + b.to(tl.float32)).to(a_ptr.dtype.element_ty)
                owner = (rm * 0 + tile % tl.num_programs(0)) == pid
                tl.store(sum_ptr + offsets, x, mask=row_ok & owner[None, :])
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, 0)
            acc = tl.dot(w, x, acc)
        scale = tl.rsqrt(squares / K + eps)
        out = out_ptr + rm[None, :] * N + rn[:, None]
        tl.store(out, (acc * scale[None, :]).to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def rms_norm_kernel(
        x_ptr, res_ptr, weight_ptr, out_ptr, sum_ptr, eps,
        N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        """out = rmsnorm(x (+ res)) * weight, a program a row; with ADD the sum to sum_ptr."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
        if ADD:
            res = tl.load(res_ptr + row * N + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * N + cols, x, mask=ok)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(x_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * N + cols, normed * weight, mask=ok)

    @triton.jit
    def elementwise_kernel(
        a_ptr, b_ptr, out_ptr, stride_a,
        N: tl.constexpr, BLOCK: tl.constexpr, OP: tl.constexpr,
    ):  # fmt: skip
        """ROTARY_PLACE: out = a[:, :N] * 1.0001 (rotary's reads and writes, little work);
        SILU_AND_MULTIPLY: out = silu(a[:, :N]) * a[:, N:2N]; ADD: out = a + b."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
        if OP == 0:  # ROTARY_PLACE (Triton reads no module globals that are not constexpr)
            y = a * 1.0001
        elif OP == 1:  # SILU_AND_MULTIPLY
            up = tl.load(a_ptr + row * stride_a + N + cols, mask=ok, other=0.0).to(tl.float32)
            y = a / (1.0 + tl.exp(-a)) * up
        else:
            y = a + tl.load(b_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def mlp_kernel(
        x_ptr, gate_up_ptr, down_ptr, act_ptr, out_ptr, sync_ptr, rows,
        H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
        BLOCK_K1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K2: tl.constexpr,
        PHASES: tl.constexpr, PREFETCH: tl.constexpr, POLL_LOADS: tl.constexpr,
    ):  # fmt: skip
        """The MLP, act = silu(x @ gate.T) * (x @ up.T) then out = act @ down.T, by the
        programs of one launch (PHASES 3: the two halves on either side of a barrier across
        the grid, every program resident) or of two (PHASES 1, then 2). With PREFETCH, each
        program asks the L2 for its first PREFETCH tiles of down before the barrier, so that
        the time the grid waits there streams weight; the weights are read evict-first, so
        the gate|up stream does not push those tiles out."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        rm = tl.arange(0, BLOCK_M)
        row_ok = (rm < rows)[None, :]
        if PHASES & 1:
            rk = tl.arange(0, BLOCK_K1)
            for item in range(pid, INTER // BLOCK_I, programs):
                ri = item * BLOCK_I + tl.arange(0, BLOCK_I)
                gate = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
                up = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
                for k in range(0, H, BLOCK_K1):
                    x = tl.load(x_ptr + rm[None, :] * H + (k + rk)[:, None], mask=row_ok, other=0.0)
                    w_gate = tl.load(
                        gate_up_ptr + ri[:, None] * H + (k + rk)[None, :],
                        eviction_policy="evict_first",
                    )
                    w_up = tl.load(
                        gate_up_ptr + (INTER + ri)[:, None] * H + (k + rk)[None, :],
                        eviction_policy="evict_first",
                    )
                    gate = tl.dot(w_gate, x, gate)
                    up = tl.dot(w_up, x, up)
                # Rounded where eager rounds: each product, SiLU's result, the multiply's.
                dtype = act_ptr.dtype.element_ty
                g = gate.to(dtype).to(tl.float32)
                silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
                tl.store(act_ptr + rm[None, :] * INTER + ri[:, None], act, mask=row_ok)
        if PREFETCH > 0 and PHASES == 3:
            # One address a 128-byte line: 64 elements of a 16-bit weight.
            lines = tl.arange(0, PREFETCH * BLOCK_K2 // 64) * 64
            for item in range(pid, H // BLOCK_N, programs):
                rows_n = item * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                    [down_ptr + rows_n[:, None] * INTER + lines[None, :]],
                    dtype=tl.int32, is_pure=False, pack=1,
                )  # fmt: skip
        if PHASES == 3:
            # A barrier across the grid: the last program to arrive resets the count and
            # moves the generation on; the others wait for that. The generation is read
            # before arriving, and only the last arrival changes it.
            generation = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            tl.debug_barrier()  # every thread's stores of act before the arrival
            arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
            if arrived == programs - 1:
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
                tl.atomic_add(sync_ptr + 1, 1, sem="release")
            elif POLL_LOADS:  # plain loads while waiting, one acquiring read at the end
                while tl.load(sync_ptr + 1, volatile=True) == generation:
                    pass
                tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            else:  # every poll an atomic read at the one address
                while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == generation:
                    pass
            tl.debug_barrier()
        if PHASES & 2:
            rk = tl.arange(0, BLOCK_K2)
            for item in range(pid, H // BLOCK_N, programs):
                rn = item * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for k in range(0, INTER, BLOCK_K2):
                    w = tl.load(
                        down_ptr + rn[:, None] * INTER + (k + rk)[None, :],
                        eviction_policy="evict_first",
                    )
                    a = tl.load(
                        act_ptr + rm[None, :] * INTER + (k + rk)[:, None], mask=row_ok,
                        other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    acc = tl.dot(w, a, acc)
                out = out_ptr + rm[None, :] * H + rn[:, None]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def parts_sum_kernel(
        parts_ptr, res_ptr, sum_ptr, weight_ptr, normed_ptr, rows, eps,
        N: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, NORM: tl.constexpr,
    ):  # fmt: skip
        """sum = res + the PARTS partial products ``[PARTS, rows, N]``; with NORM (a program a
        whole row) also normed = rmsnorm(sum) * weight."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.load(res_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        for part in tl.static_range(PARTS):
            offsets = (part * rows + row) * N + cols
            acc += tl.load(parts_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        total = acc.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, total, mask=ok)
        if NORM:
            xf = total.to(tl.float32)
            normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(sum_ptr.dtype.element_ty)
            weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
            tl.store(normed_ptr + row * N + cols, normed * weight, mask=ok)

    return _Kernels(
        product_kernel,
        norm_product_kernel,
        rms_norm_kernel,
        elementwise_kernel,
        mlp_kernel,
        parts_sum_kernel,
    )


def _whole_tiles(w: torch.Tensor, block_n: int, block_k: int) -> tuple[int, int]:
    """The weight's shape, which the products' loops take in whole tiles, unmasked."""
    n, k = w.shape
    if n % block_n or k % block_k:
        raise ValueError(f"a {n} x {k} weight is not whole {block_n} x {block_k} tiles")
    return n, k


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def product(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    tiles: tuple[int, int, int, int],
    residual: torch.Tensor | None = None,
) -> None:
    """out = x @ w.T (+ residual), every tensor contiguous."""
    block_n, block_k, warps, stages = tiles
    n, k = _whole_tiles(w, block_n, block_k)
    _kernels().product[(n // block_n,)](
        x, w, x if residual is None else residual, out, x.shape[0], K=k, N=n,
        BLOCK_M=_block_m(x.shape[0]), BLOCK_N=block_n, BLOCK_K=block_k,
        RESIDUAL=residual is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def norm_product(
    a: torch.Tensor,
    b: torch.Tensor | None,
    total: torch.Tensor | None,
    w_folded: torch.Tensor,
    out: torch.Tensor,
    tiles: tuple[int, int, int, int],
) -> None:
    """out = rmsnorm(a (+ b)) @ w_folded.T; with b, a + b is written to ``total``."""
    block_n, block_k, warps, stages = tiles
    n, k = _whole_tiles(w_folded, block_n, block_k)
    _kernels().norm_product[(n // block_n,)](
        a, a if b is None else b, a if total is None else total, w_folded, out, a.shape[0],
        _EPS, K=k, N=n, BLOCK_M=_block_m(a.shape[0]), BLOCK_N=block_n, BLOCK_K=block_k,
        ADD=b is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> None:
    """out = rmsnorm(x (+ residual)) * weight; with a residual, the sum to ``total``."""
    rows, n = x.shape
    _kernels().rms_norm[(rows,)](
        x, x if residual is None else residual, weight, out, x if total is None else total,
        _EPS, N=n, BLOCK=1 << (n - 1).bit_length(), ADD=residual is not None,
    )  # fmt: skip


def elementwise(op: int, a: torch.Tensor, out: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """``elementwise_kernel``'s ``op`` (ROTARY_PLACE, SILU_AND_MULTIPLY or ADD) over
    ``out``'s columns."""
    rows, n = out.shape
    block = 1024
    _kernels().elementwise[(rows, -(-n // block))](
        a, a if b is None else b, out, a.stride(0), N=n, BLOCK=block, OP=op
    )


def parts_sum(
    parts: torch.Tensor,
    residual: torch.Tensor,
    total: torch.Tensor,
    weight: torch.Tensor | None = None,
    normed: torch.Tensor | None = None,
) -> None:
    """total = residual + parts.sum(0); with ``weight``, normed = rmsnorm(total) * weight."""
    _, rows, n = parts.shape
    norm = weight is not None
    block = 1 << (n - 1).bit_length() if norm else 1024
    _kernels().parts_sum[(rows, -(-n // block))](
        parts, residual, total, residual if weight is None else weight,
        total if normed is None else normed, rows, _EPS, N=n, BLOCK=block, PARTS=parts.shape[0],
        NORM=norm,
    )  # fmt: skip


def mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: torch.Tensor,
    out: torch.Tensor,
    sync: torch.Tensor,
    tiles: MlpTiles,
    persistent: bool = True,
) -> None:
    """out = (silu(x @ gate.T) * (x @ up.T)) @ down.T, ``gate_up`` the two weights stacked
    (gate's rows first) and ``act`` the scratch between the halves. Persistent: one program
    an SM (``sync``, two int32 zeros, holds the barrier's count and generation); else two
    launches."""
    hidden, inter = down.shape
    _whole_tiles(gate_up[:inter], tiles.block_i, tiles.block_k1)
    _whole_tiles(down, tiles.block_n, tiles.block_k2)
    first, second = inter // tiles.block_i, hidden // tiles.block_n
    kernel = _kernels().mlp
    args = (x, gate_up, down, act, out, sync, x.shape[0])
    meta = dict(
        H=hidden, INTER=inter, BLOCK_M=_block_m(x.shape[0]), BLOCK_I=tiles.block_i,
        BLOCK_K1=tiles.block_k1, BLOCK_N=tiles.block_n, BLOCK_K2=tiles.block_k2,
        PREFETCH=tiles.prefetch if x.device.type == "cuda" else 0,  # PHASES 3 alone reads it
        POLL_LOADS=tiles.poll_loads,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    if persistent:
        kernel[(min(max(first, second), _resident_programs(x.device)),)](*args, PHASES=3, **meta)
    else:
        kernel[(first,)](*args, PHASES=1, **meta)
        kernel[(second,)](*args, PHASES=2, **meta)


def _resident_programs(device: torch.device) -> int:
    """How many programs of a persistent kernel are sure to be resident at once: one an SM
    (its tiles need most of an SM's shared memory); 1 on the CPU, whose interpreter runs
    programs one after another."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class LayerWeights:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_folded: torch.Tensor  # the input norm's weight folded in, column by column
    gate_up_folded: torch.Tensor

    @classmethod
    def random(cls, hidden: int, qkv: int, inter: int, device: str, dtype: torch.dtype):
        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=device) * 0.02).to(dtype)

        def norm() -> torch.Tensor:
            return (torch.rand(hidden, device=device) + 0.5).to(dtype)

        qkv_w, gate_up_w = weight(qkv, hidden), weight(2 * inter, hidden)
        input_norm, post_norm = norm(), norm()
        return cls(
            qkv_w, weight(hidden, hidden), gate_up_w, weight(hidden, inter), input_norm,
            post_norm, (qkv_w.float() * input_norm.float()).to(dtype),
            (gate_up_w.float() * post_norm.float()).to(dtype),
        )  # fmt: skip


@dataclass
class LayerParts:
    """A layer's weights cut into parts that share no work until their sums: each part's
    q|k|v rows for its own heads (query and KV heads alike), o's columns for those heads, its
    rows of gate and of up, and down's columns for those rows. Every weight byte is read once,
    as by the whole layer; o's and down's partial products are summed at the joins."""

    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor

    @classmethod
    def cut(cls, w: LayerWeights, parts: int, heads: int, kv_heads: int, head_dim: int):
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        q, k, v = w.qkv.split([q_rows, kv_rows, kv_rows])
        inter = w.down.shape[1]
        gate, up = w.gate_up.split([inter, inter])

        def cut_rows(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return t.chunk(parts, dim=0)

        def cut_cols(t: torch.Tensor) -> list[torch.Tensor]:
            return [c.contiguous() for c in t.chunk(parts, dim=1)]

        return cls(
            [torch.cat(qkv) for qkv in zip(cut_rows(q), cut_rows(k), cut_rows(v), strict=True)],
            cut_cols(w.o),
            [torch.cat(gu) for gu in zip(cut_rows(gate), cut_rows(up), strict=True)],
            cut_cols(w.down),
            w.input_norm,
            w.post_norm,
        )


class PartActivations:
    """The activations of a layer cut into ``parts``: the whole rows' buffers, each part's
    own, and the partial products that the joins sum."""

    def __init__(self, rows: int, hidden: int, qkv: int, inter: int, parts: int, device: str,
                 dtype) -> None:  # fmt: skip
        def buffer(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device).to(dtype)

        self.hidden, self.residual, self.normed = (buffer(rows, hidden) for _ in range(3))
        self.qkv = [buffer(rows, qkv // parts) for _ in range(parts)]
        self.query = [buffer(rows, hidden // parts) for _ in range(parts)]
        self.attn = [buffer(rows, hidden // parts) for _ in range(parts)]
        self.gate_up = [buffer(rows, 2 * inter // parts) for _ in range(parts)]
        self.act = [buffer(rows, inter // parts) for _ in range(parts)]
        self.o_parts, self.down_parts = buffer(parts, rows, hidden), buffer(parts, rows, hidden)


class Activations:
    """A step's activations, reused by every layer (as the graph's pool reuses them)."""

    def __init__(self, rows: int, hidden: int, qkv: int, inter: int, device: str, dtype):
        def buffer(n: int) -> torch.Tensor:
            return torch.randn(rows, n, device=device).to(dtype)

        self.hidden, self.residual, self.mlp_out = buffer(hidden), buffer(hidden), buffer(hidden)
        self.normed, self.attn, self.o = buffer(hidden), buffer(hidden), buffer(hidden)
        self.qkv, self.gate_up, self.act = buffer(qkv), buffer(2 * inter), buffer(inter)
        self.query = buffer(hidden)
        self.sync = torch.zeros(2, dtype=torch.int32, device=device)  # the MLP's barrier


@dataclass
class Sequences:
    """Some of the step's sequences, as the decode kernel reads them."""

    block_tables: torch.Tensor  # flat int32
    width: torch.Tensor  # one element
    context_lens: torch.Tensor

    def __getitem__(self, rows: slice) -> Sequences:
        width = self.block_tables.numel() // self.context_lens.numel()
        tables = self.block_tables.view(-1, width)[rows].reshape(-1)
        return Sequences(tables, self.width, self.context_lens[rows])


class Attention:
    """The engine's decode attention over a layer's own paged cache (its keys and values
    random, every sequence at ``context`` tokens, the blocks shuffled); the rows' own keys
    and values are not stored, which the engine does in the same launch."""

    def __init__(self, rows: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 layers: int, device: str, dtype, head_major: bool = False,
                 heads_per_program: int | None = None) -> None:  # fmt: skip
        block = 16
        width = -(-context // block)
        blocks = rows * width
        self.heads, self.head_dim, self.block = heads, head_dim, block
        self.heads_per_program = heads_per_program

        def cache() -> torch.Tensor:
            """``[slots, kv_heads, head_dim]`` as the engine has it, or a view of a head-major
            cache (each head's slots together: a block of one head one contiguous run)."""
            if head_major:
                planes = torch.randn(kv_heads, blocks * block, head_dim, device=device)
                return planes.to(dtype).permute(1, 0, 2)
            return torch.randn(blocks * block, kv_heads, head_dim, device=device, dtype=dtype)

        self.caches = [(cache(), cache()) for _ in range(layers)]
        self.sequences = Sequences(
            torch.randperm(blocks, device=device).to(torch.int32),
            torch.tensor([width], device=device),
            torch.full((rows,), context, dtype=torch.int32, device=device),
        )

    def __call__(self, layer: int, x: Activations, seqs: Sequences) -> None:
        self.attend(layer, x.query, x.attn, seqs)

    def attend(self, layer: int, query: torch.Tensor, out: torch.Tensor, seqs: Sequences,
               part: int = 0, parts: int = 1) -> None:  # fmt: skip
        """``query`` ``[rows, heads * head_dim]`` to ``out`` over the cache's KV heads, or
        over part ``part`` of ``parts`` of them (``query`` then that part's heads alone)."""
        from cbpipe.worker.kernels.paged_decode import paged_decode_attention

        rows = query.shape[0]
        heads = query.shape[1] // self.head_dim
        keys, values = (c.chunk(parts, dim=1)[part] for c in self.caches[layer])
        paged_decode_attention(
            query.view(rows, heads, self.head_dim), keys, values, seqs.block_tables,
            seqs.width, seqs.context_lens, block_size=self.block, scale=self.head_dim**-0.5,
            heads_per_program=self.heads_per_program,
            out=out.view(rows, heads, self.head_dim),
        )  # fmt: skip


Attend = Callable[[Activations], None]
# Where the two halves' kernels interleave, a layer's kernels have no fixed positions.
TWO_STREAMS = "engine, halves on two streams"
CUT_PARTS = (2, 4)


def cut_chain(parts: int, streams: bool) -> str:
    where = f"on {parts} streams" if streams else "in turn"
    return f"engine, cut in {parts} {where}"


MULTI_STREAM = {TWO_STREAMS, *(cut_chain(parts, True) for parts in CUT_PARTS)}


def rotary_and_attention(qkv: torch.Tensor, x: Activations, attend: Attend | None) -> None:
    """Rotary's place, then attention into ``x.attn`` (or, without attention, rotary's
    output there directly)."""
    elementwise(ROTARY_PLACE, qkv, x.attn if attend is None else x.query)
    if attend is not None:
        attend(x)


def engine_layer(
    w: LayerWeights,
    x: Activations,
    triton_products: bool = False,
    attend: Attend | None = None,
    mlp_tiles: MlpTiles | None = None,
    persistent: bool = True,
) -> None:
    """The worker's compiled layer, with attention or without; with ``mlp_tiles`` its MLP
    (gate|up, SiLU-and-multiply, down) is this script's MLP kernel."""

    def linear(inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tiles) -> torch.Tensor:
        if not triton_products:
            return F.linear(inp, weight)
        product(inp, weight, out, tiles)
        return out

    rms_norm(x.hidden, w.input_norm, x.normed)
    qkv = linear(x.normed, w.qkv, x.qkv, QKV_TILES)
    rotary_and_attention(qkv, x, attend)
    o = linear(x.attn, w.o, x.o, O_TILES)
    rms_norm(o, w.post_norm, x.normed, residual=x.hidden, total=x.residual)
    if mlp_tiles is not None:
        mlp(x.normed, w.gate_up, w.down, x.act, x.mlp_out, x.sync, mlp_tiles, persistent)
    else:
        gate_up = linear(x.normed, w.gate_up, x.gate_up, GATE_UP_TILES)
        elementwise(SILU_AND_MULTIPLY, gate_up, x.act)
        torch.mm(x.act, w.down.t(), out=x.mlp_out)
    elementwise(ADD, x.residual, x.hidden, x.mlp_out)  # the boundary add


def fused_layer(
    w: LayerWeights, x: Activations, fuse_gate_up: bool = True, attend: Attend | None = None
) -> None:
    """The same layer with the products taking the norms and residual adds in; the
    boundary add moves into the next layer's q|k|v."""
    norm_product(x.residual, x.mlp_out, x.hidden, w.qkv_folded, x.qkv, QKV_ADD_TILES)
    rotary_and_attention(x.qkv, x, attend)
    product(x.attn, w.o, x.residual, O_TILES, residual=x.hidden)
    gate_up = x.gate_up
    if fuse_gate_up:
        norm_product(x.residual, None, None, w.gate_up_folded, gate_up, GATE_UP_TILES)
    else:
        rms_norm(x.residual, w.post_norm, x.normed)
        gate_up = F.linear(x.normed, w.gate_up)
    elementwise(SILU_AND_MULTIPLY, gate_up, x.act)
    torch.mm(x.act, w.down.t(), out=x.mlp_out)


PartAttend = Callable[[int, PartActivations], None]  # (part, activations)


def split_layer(
    w: LayerParts,
    x: PartActivations,
    attend: PartAttend | None = None,
    side_streams: list[torch.cuda.Stream] | None = None,
) -> None:
    """The engine's layer cut into ``LayerParts``: the input norm, then each part's q|k|v,
    rotary's place, attention and o into its partial product, joined by the sum of o's
    partials with the residual and the second norm; then each part's gate|up,
    SiLU-and-multiply and down into its partial product, joined by the boundary add. The
    first part on the current stream and each other on its own of ``side_streams``, or all in
    turn."""
    parts = len(w.qkv)

    def in_parts(work: Callable[[int], None]) -> None:
        if side_streams is None:
            for part in range(parts):
                work(part)
            return
        main = torch.cuda.current_stream()
        streams = [main, *side_streams[: parts - 1]]
        for stream in streams[1:]:
            stream.wait_stream(main)
        for part, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                work(part)
        for stream in streams[1:]:
            main.wait_stream(stream)

    def attention_part(part: int) -> None:
        torch.mm(x.normed, w.qkv[part].t(), out=x.qkv[part])
        elementwise(ROTARY_PLACE, x.qkv[part], x.attn[part] if attend is None else x.query[part])
        if attend is not None:
            attend(part, x)
        torch.mm(x.attn[part], w.o[part].t(), out=x.o_parts[part])

    def mlp_part(part: int) -> None:
        torch.mm(x.normed, w.gate_up[part].t(), out=x.gate_up[part])
        elementwise(SILU_AND_MULTIPLY, x.gate_up[part], x.act[part])
        torch.mm(x.act[part], w.down[part].t(), out=x.down_parts[part])

    rms_norm(x.hidden, w.input_norm, x.normed)
    in_parts(attention_part)
    parts_sum(x.o_parts, x.hidden, x.residual, w.post_norm, x.normed)
    in_parts(mlp_part)
    parts_sum(x.down_parts, x.residual, x.hidden)


def captured(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``fn`` run once, then captured in a CUDA graph that has been replayed once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


LayerKind = Callable[[LayerWeights, Activations, Attend | None], None]


def graph_us(fn: Callable[[], None], repeats: int = 15) -> float:
    """The median of ``repeats`` replays of ``fn`` captured in one CUDA graph, in us."""
    from cbpipe.roofline import graph_replay_ms

    return statistics.median(graph_replay_ms(captured(fn), repeats)) * 1000


def kernel_breakdown(fn: Callable[[], None], layers: int) -> list[tuple[str, float, float]]:
    """Each kernel of a layer in ``fn``'s graph, as the profiler saw one replay: (name, its
    time, the gap before the next kernel), in us, averaged over the layers by position."""
    from cbpipe.roofline import graph_kernels

    kernels = graph_kernels(captured(fn))
    if not kernels or len(kernels) % layers:
        raise RuntimeError(f"the profiler saw {len(kernels)} kernels for {layers} layers")
    per_layer = len(kernels) // layers
    by_position = [kernels[position::per_layer] for position in range(per_layer)]
    return [
        (
            same_place[0].name,
            sum(k.us for k in same_place) / layers,
            sum(k.gap_us for k in same_place) / layers,
        )
        for same_place in by_position
    ]


def self_check() -> None:
    """Each kernel against torch at sizes the interpreter gets through quickly."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before _kernels() imports triton
    torch.manual_seed(0)
    rows, hidden, out_features = 5, 256, 64
    tiles = (16, 128, 1, 1)

    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        print(f"ok: {what}")

    def reference_norm(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        v = v.float()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + _EPS) * weight.float()

    a = torch.randn(rows, hidden, device=device).to(dtype)
    b = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(out_features, hidden, device=device) * 0.1).to(dtype)
    g = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    res = torch.randn(rows, out_features, device=device).to(dtype)
    out = torch.empty(rows, out_features, device=device, dtype=dtype)

    product(a, w, out, tiles)
    close(out, a.float() @ w.float().T, "product")
    product(a, w, out, tiles, residual=res)
    close(out, res.float() + a.float() @ w.float().T, "product with the residual add")

    folded = (w.float() * g.float()).to(dtype)
    total = torch.zeros_like(a)
    norm_product(a, b, total, folded, out, tiles)
    summed = (a.float() + b.float()).to(dtype)
    close(total, summed, "the sum, written once")
    close(out, reference_norm(summed, g) @ w.float().T, "add, norm and product")
    norm_product(a, None, None, folded, out, tiles)
    close(out, reference_norm(a, g) @ w.float().T, "norm and product")

    normed, total = torch.empty_like(a), torch.zeros_like(a)
    rms_norm(a, g, normed)
    close(normed, reference_norm(a, g), "norm")
    rms_norm(a, g, normed, residual=b, total=total)
    close(normed, reference_norm(summed, g), "add and norm")
    close(total, summed, "add and norm's sum")

    wide = torch.randn(rows, 2 * hidden, device=device).to(dtype)
    half = torch.empty(rows, hidden, device=device, dtype=dtype)
    elementwise(SILU_AND_MULTIPLY, wide, half)
    close(half, F.silu(wide[:, :hidden].float()) * wide[:, hidden:].float(), "SiLU and multiply")
    elementwise(ADD, a, half, b)
    close(half, a.float() + b.float(), "add")

    inter = 128
    gate_up = (torch.randn(2 * inter, hidden, device=device) * 0.1).to(dtype)
    down = (torch.randn(hidden, inter, device=device) * 0.1).to(dtype)
    act = torch.empty(rows, inter, device=device, dtype=dtype)
    mlp_out = torch.empty(rows, hidden, device=device, dtype=dtype)
    sync = torch.zeros(2, dtype=torch.int32, device=device)
    both = (a @ gate_up.T).float()
    want_act = (F.silu(both[:, :inter]) * both[:, inter:]).to(dtype)
    for persistent, poll_loads in ((True, False), (True, True), (False, False)):
        mlp_out.zero_()
        tiles = MlpTiles(32, 64, 64, 64, 1, 1, poll_loads=poll_loads)
        mlp(a, gate_up, down, act, mlp_out, sync, tiles, persistent)
        how = "one launch" if persistent else "two launches"
        how += ", polling loads" if poll_loads else ""
        close(mlp_out, want_act.float() @ down.float().T, f"the MLP in {how}")
    if device == "cuda":  # each launch passed the barrier once, and left its count at zero
        assert sync.tolist() == [0, 2], sync.tolist()

    parts_of = torch.randn(3, rows, hidden, device=device).to(dtype)
    parts_sum(parts_of, a, total, g, normed)
    summed = (a.float() + parts_of.float().sum(0)).to(dtype)
    close(total, summed, "the parts' sum")
    close(normed, reference_norm(summed, g), "the parts' sum and norm")

    # The layer cut in parts computes the whole layer (attention's place taken by rotary's).
    heads, kv_heads, head_dim = 4, 2, 64
    qkv_size = (heads + 2 * kv_heads) * head_dim
    layer = LayerWeights.random(hidden, qkv_size, inter, device, dtype)
    whole = Activations(rows, hidden, qkv_size, inter, device, dtype)
    start = whole.hidden.clone()
    engine_layer(layer, whole)
    for parts in CUT_PARTS:
        split = PartActivations(rows, hidden, qkv_size, inter, parts, device, dtype)
        split.hidden.copy_(start)
        split_layer(LayerParts.cut(layer, parts, heads, kv_heads, head_dim), split)
        close(split.hidden, whole.hidden, f"the layer cut in {parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-8b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--context", type=int, default=0,
        help="with attention, every sequence at this many tokens (0: without attention)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--self-check", action="store_true", help=self_check.__doc__)
    parser.add_argument(
        "--kernels", action="store_true", help="also each chain's kernels, from the profiler"
    )
    parser.add_argument(
        "--cache-layouts", action="store_true",
        help="with --context, only the engine's chain over the cache as the engine lays it "
        "out (its heads side by side, two a program at head_dim 64), one head a program, "
        "and a head-major cache (each head's slots together)",
    )  # fmt: skip
    parser.add_argument("--match", help="only the chains whose names match this regex")
    args = parser.parse_args(argv)
    if args.self_check:
        self_check()
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_layer_chain.py times CUDA kernels: no GPU here (--self-check runs on CPU)")

    from cbpipe.models import resolve_model
    from cbpipe.worker.blas import use_blas_library

    text = resolve_model(args.model).config.get_text_config()
    heads, hidden = text.num_attention_heads, text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    qkv = (heads + 2 * kv_heads) * head_dim
    inter = text.intermediate_size
    print(f"{args.model}: {args.rows} rows, hidden {hidden}, q|k|v {qkv}, intermediate {inter}")
    device, dtype = "cuda", torch.bfloat16
    use_blas_library("auto", torch.device(device))
    weights = [LayerWeights.random(hidden, qkv, inter, device, dtype) for _ in range(args.layers)]
    attention = None
    if args.context:
        attention = Attention(
            args.rows, args.context, heads, kv_heads, head_dim, args.layers, device, dtype
        )
        print(f"with attention: {heads} heads, {kv_heads} KV heads of {head_dim}, context "
              f"{args.context}")  # fmt: skip

    def attend(
        layer: int,
        seqs: Sequences | None = None,
        then: torch.cuda.Event | None = None,
        over: Attention | None = None,
    ) -> Attend | None:
        """Layer ``layer``'s attention (``over`` another cache than the engine's) over
        ``seqs`` (all of them by default), recording the event ``then`` after it."""
        if attention is None:
            return None
        cache = over or attention
        chosen = cache.sequences if seqs is None else seqs

        def run(x: Activations) -> None:
            cache(layer, x, chosen)
            if then is not None:
                then.record()

        return run

    def attend_part(layer: int, parts: int) -> PartAttend | None:
        """Layer ``layer``'s attention for one part of ``parts`` of its heads."""
        if attention is None:
            return None

        def run(part: int, x: PartActivations) -> None:
            attention.attend(layer, x.query[part], x.attn[part], attention.sequences, part, parts)

        return run

    def cut_chain_run(
        cut: list[LayerParts], x: PartActivations, side: list[torch.cuda.Stream] | None
    ) -> Callable[[], None]:
        def run() -> None:
            for i, w in enumerate(cut):
                split_layer(w, x, attend_part(i, len(w.qkv)), side)

        return run

    layer_kinds: dict[str, LayerKind] = {
        "engine": lambda w, x, a: engine_layer(w, x, attend=a),
        "triton products": lambda w, x, a: engine_layer(w, x, triton_products=True, attend=a),
        "fused": lambda w, x, a: fused_layer(w, x, attend=a),
        "fused, cuBLASLt gate|up": lambda w, x, a: fused_layer(w, x, fuse_gate_up=False, attend=a),
    }

    def with_mlp(tiles: MlpTiles, persistent: bool = True) -> LayerKind:
        return lambda w, x, a: engine_layer(w, x, attend=a, mlp_tiles=tiles, persistent=persistent)

    for tiles_name, tiles in MLP_TILES.items():
        layer_kinds[f"persistent MLP, {tiles_name}"] = with_mlp(tiles)
    layer_kinds["MLP in two launches, k64 x4"] = with_mlp(MLP_BASE_TILES, persistent=False)

    batch = Activations(args.rows, hidden, qkv, inter, device, dtype)  # the chains take turns

    def whole_batch(kind: LayerKind, over: Attention | None = None) -> Callable[[], None]:
        def run() -> None:
            for i, w in enumerate(weights):
                kind(w, batch, attend(i, over=over))

        return run

    if args.cache_layouts:
        layer_kinds = {"engine": layer_kinds["engine"]}
    elif args.rows > MAX_TRITON_ROWS:
        print(f"the Triton products keep every row in one tile: at {args.rows} rows only the "
              "engine's chains run")  # fmt: skip
        layer_kinds = {"engine": layer_kinds["engine"]}
    chains: dict[str, Callable[[], None]] = {
        name: whole_batch(kind) for name, kind in layer_kinds.items()
    }
    if attention is not None and args.cache_layouts:
        layouts = {
            "engine, 1 head a program": Attention(
                args.rows, args.context, heads, kv_heads, head_dim, args.layers, device, dtype,
                heads_per_program=1,
            ),
            "engine, head-major cache": Attention(
                args.rows, args.context, heads, kv_heads, head_dim, args.layers, device, dtype,
                head_major=True,
            ),
        }  # fmt: skip
        for name, cache in layouts.items():
            chains[name] = whole_batch(layer_kinds["engine"], over=cache)
    elif attention is not None:
        # The batch in two halves: each product reads its weight twice, but one half's
        # attention, bound by the cache's bytes, can run beside the other's products.
        half = args.rows // 2
        halves = [Activations(half, hidden, qkv, inter, device, dtype) for _ in range(2)]
        seqs = [attention.sequences[:half], attention.sequences[half:]]
        side = torch.cuda.Stream()
        started = torch.cuda.Event()

        def halves_in_turn() -> None:
            for i, w in enumerate(weights):
                for x, s in zip(halves, seqs, strict=True):
                    engine_layer(w, x, attend=attend(i, s))

        def halves_on_two_streams() -> None:
            # The second half starts once the first has passed its first attention: from
            # there one half's attention falls beside the other's products.
            side.wait_stream(torch.cuda.current_stream())
            for i, w in enumerate(weights):
                engine_layer(w, halves[0], attend=attend(i, seqs[0], started if i == 0 else None))
            with torch.cuda.stream(side):
                side.wait_event(started)
                for i, w in enumerate(weights):
                    engine_layer(w, halves[1], attend=attend(i, seqs[1]))
            torch.cuda.current_stream().wait_stream(side)

        chains["engine, halves in turn"] = halves_in_turn
        chains[TWO_STREAMS] = halves_on_two_streams

    def wanted(name: str) -> bool:
        return not args.match or re.search(args.match, name) is not None

    if not args.cache_layouts:
        side_streams = [torch.cuda.Stream() for _ in range(max(CUT_PARTS) - 1)]
        for parts in CUT_PARTS:
            streams: dict[str, list[torch.cuda.Stream] | None]
            streams = {cut_chain(parts, True): side_streams}
            if parts == 2:
                streams[cut_chain(parts, False)] = None
            streams = {name: on for name, on in streams.items() if wanted(name)}
            if heads % parts or kv_heads % parts or not streams:
                continue  # a cut holds a copy of every weight: none unless it is timed
            cut = [LayerParts.cut(w, parts, heads, kv_heads, head_dim) for w in weights]
            acts = PartActivations(args.rows, hidden, qkv, inter, parts, device, dtype)
            for name, on in streams.items():
                chains[name] = cut_chain_run(cut, acts, on)
    chains = {name: chain for name, chain in chains.items() if wanted(name)}

    results: dict[str, list[float]] = {name: [] for name in chains}
    for name, chain in list(chains.items()):  # a chain that fails to build is reported, not fatal
        try:
            captured(chain)
        except Exception as exc:  # noqa: BLE001 (Triton's and CUDA's errors have no common base)
            print(f"{name}: failed, {type(exc).__name__}: {str(exc)[:400]}")
            del chains[name], results[name]
    for _ in range(2):  # twice, alternating, so a host's drift shows as a spread
        for name, chain in chains.items():
            results[name].append(graph_us(chain) / args.layers)
    for name, runs in results.items():
        print(f"{name:>30}: {' '.join(f'{r:6.1f}' for r in runs)} us a layer")
    kernels: dict[str, list[tuple[str, float, float]]] = {}
    for name, chain in chains.items() if args.kernels else ():
        if name in MULTI_STREAM:
            continue
        kernels[name] = kernel_breakdown(chain, args.layers)
        print(f"{name}, a layer's kernels (us: the kernel, then the gap after it):")
        for kernel, busy, gap in kernels[name]:
            print(f"  {busy:6.1f} {gap:5.1f}  {kernel[:90]}")
        total_busy = sum(busy for _, busy, _ in kernels[name])
        total_gap = sum(gap for _, _, gap in kernels[name])
        print(f"  {total_busy:6.1f} {total_gap:5.1f}  in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "rows": args.rows,
                    "context": args.context,
                    "us_a_layer": results,
                    "kernels": kernels,
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
