"""The decode step's matrix products alone on the GPU: how close each comes to the copy rate.

    python scripts/bench_matmul.py [--model random:llama-8b] [--batch 32 256] [--json PATH]

A decode step multiplies a few rows (one per sequence) by every weight matrix, so each
product should take the time to read its weight. For each projection of one decoder layer
(q, k, v, o, gate, up, down), the output head, and the fused products a model could use
instead (q|k|v in one matrix, gate|up in one), this times ``F.linear`` at each batch size and
reports the weight bytes read per second against the device's measured copy bandwidth
(``cbpipe.roofline.copy_bandwidth``, reads plus writes: a product that only reads can pass
1.0), and the layer's total time separate against fused. Each product is timed through
cuBLAS (torch's default for these) and through cuBLASLt (``preferred_blas_library``, whose
own heuristics may pick other kernels, split-K among them).

Each shape cycles through enough copies of its weight to exceed the L2 cache, as the layers of
a real model do, and the loop is replayed from a CUDA graph so launch overhead does not count.

A split-K Triton kernel for these products was swept against cuBLAS on an H200 (commit
1215f6b, docs/PERFORMANCE.md) and lost or tied on every one at batch 32, where they are bound
by the weight's bytes, so the engine keeps cuBLAS there.

``--candidate`` times a second Triton kernel, written for the rows a large batch brings (the
1B at 256 rows), where the small products are bound by arithmetic and cuBLAS leaves SMs idle:
the down product (256 x 8192 by 8192 x 2048) has 16-32 output tiles of the usual sizes for
132 SMs. The candidate tiles the output in both dimensions and splits K, so a product of few
output tiles still makes a full wave of programs; its partial sums are reduced in a fixed
order (the same sums every run). It is swept over tile sizes, splits and pipeline depths at
each ``--batch`` for q|k|v, o and down, beside cuBLAS and cuBLASLt, and reports the best
configuration per product. Nothing in the engine uses it unless it wins here.
``--lt-algos N`` times cuBLASLt's first N algorithms for each product beside the one torch
runs (through ctypes: torch cannot be told which to run), to see whether another reads the
weights faster (its section below says why).
``--self-check`` runs it against ``x @ w.T`` at small sizes and exits: on a GPU if there is
one, else under Triton's CPU interpreter.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

L2_BYTES_TO_EXCEED = 512 << 20


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each product of one layer, the head and the fusions."""
    text = config.get_text_config()
    hidden, inter = text.hidden_size, text.intermediate_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q": (q, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, q),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
        "qkv": (q + 2 * kv, hidden),
        "gate_up": (2 * inter, hidden),
        "lm_head": (text.vocab_size, hidden),
    }


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def time_product(
    rows: int, shape: tuple[int, int], dtype: torch.dtype, iters: int, product: Product = F.linear
) -> float:
    """Median seconds of one ``product(x, w)`` of ``rows`` rows by a weight of ``shape``."""
    from cbpipe.roofline import graph_replay_ms

    out_features, in_features = shape
    weight_bytes = out_features * in_features * dtype.itemsize
    copies = max(2, min(64, -(-L2_BYTES_TO_EXCEED // weight_bytes)))
    weights = [torch.randn(shape, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype)
    for w in weights:  # warm up heuristics, workspaces and compilation before capture
        product(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            product(x, w)
    samples = [ms / 1e3 / copies for ms in graph_replay_ms(graph, iters)]
    del graph, weights
    torch.cuda.empty_cache()
    return statistics.median(samples)


# --- the candidate kernel ------------------------------------------------------------------


@functools.cache
def _kernels():  # type: ignore[no-untyped-def]
    """Compiled lazily: triton reads TRITON_INTERPRET when imported."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiled_split_k_kernel(
        x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):  # fmt: skip
        # Row tiles vary fastest, so the programs that read one weight tile run together
        # and the weight comes from DRAM once.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = pid_k * k_per_split + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # w.T's tile: K down, N across
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_per_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if PARTIAL:
            tl.store(out_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
        else:
            out = out_ptr + rm[:, None] * stride_om + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def reduce_kernel(
        part_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # a fixed order: the same sums every run
            acc += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0.0)
        out = out_ptr + (offs // N) * stride_om + offs % N
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, tiled_split_k_kernel, reduce_kernel


def tiled_split_k_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    split_k: int = 4,
    num_warps: int = 8,
    num_stages: int = 3,
    reduce: bool = True,
) -> torch.Tensor:
    """``x @ w.T``: programs over row tiles x column tiles x K ranges.

    With ``reduce=False`` and ``split_k > 1`` it returns the float32 partial sums
    ``[split_k, rows, out]`` unreduced: what a graph that adds them into its residual itself
    would take, timed for the bound it sets.
    """
    triton, tiled_split_k_kernel, reduce_kernel = _kernels()
    (m, k), n = x.shape, w.shape[0]
    if k % (split_k * block_k):
        raise ValueError(f"K={k} is not a multiple of split_k x block_k = {split_k * block_k}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need contiguous rows")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = split_k > 1
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    tiled_split_k_kernel[grid](
        x, w, part, m, n, x.stride(0), w.stride(0), out.stride(0), k // split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=partial,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not partial:
        return out
    if not reduce:
        return part
    block = 1024
    reduce_kernel[(triton.cdiv(m * n, block),)](
        part, out, m, n, out.stride(0), SPLIT_K=split_k, BLOCK=block
    )
    return out


def candidate_configs(rows: int, in_features: int) -> list[dict[str, int]]:
    """The sweep: tiles that hold at least 64 rows, every split that divides K, and the
    pipeline depths whose stages fit in shared memory (about 200 KB of the H200's 228)."""
    configs = []
    for block_m, block_n, block_k, split_k, num_stages in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), (1, 2, 4, 8), (3, 4)
    ):
        if block_m > max(64, rows) or in_features % (block_k * split_k):
            continue
        if num_stages * (block_m + block_n) * block_k * 2 > 200 * 1024:
            continue
        configs.append(
            {
                "block_m": block_m,
                "block_n": block_n,
                "block_k": block_k,
                "split_k": split_k,
                "num_warps": 8 if block_m * block_n >= 128 * 128 else 4,
                "num_stages": num_stages,
            }
        )
    return configs


def self_check() -> None:
    """The candidate against ``x @ w.T`` at sizes the interpreter gets through quickly."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before _kernels() imports triton
    generator = torch.Generator().manual_seed(0)
    # rows, out, in, block_m, block_n, block_k, split: ragged row and column tiles, one
    # split and several, more row tiles than one.
    cases = [(3, 48, 64, 16, 32, 32, 1), (40, 40, 128, 16, 16, 32, 2), (33, 32, 96, 32, 16, 16, 3)]
    for m, n, k, block_m, block_n, block_k, split_k in cases:
        x = torch.randn(m, k, generator=generator).to(device, dtype)
        w = torch.randn(n, k, generator=generator).to(device, dtype)
        config = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k)
        got = tiled_split_k_linear(x, w, num_warps=1, num_stages=1, **config)
        want = (x.float() @ w.float().T).to(dtype)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        again = tiled_split_k_linear(x, w, num_warps=1, num_stages=1, **config)
        assert torch.equal(got, again), "split-K sums must not vary between runs"
        if split_k > 1:
            part = tiled_split_k_linear(x, w, num_warps=1, num_stages=1, reduce=False, **config)
            torch.testing.assert_close(part.sum(0).to(dtype), want, rtol=2e-2, atol=2e-2)
        print(
            f"ok: {m} x {k} by {n} x {k}, tiles {block_m} x {block_n} x {block_k}, split {split_k}"
        )


def _cublaslt_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


# --- cuBLASLt's algorithms -----------------------------------------------------------------
#
# torch asks cuBLASLt's heuristic for one algorithm a product and runs it; the heuristic ranks
# only what fits the workspace torch declares (``CUBLASLT_WORKSPACE_SIZE`` KiB: 1 MiB unless
# set, where torch keeps cuBLASLt's workspace apart from cuBLAS's; cuBLAS's, 32 MiB on
# Hopper, where it unifies them). ``--lt-algos N`` asks for N algorithms with 32 MiB offered,
# marks the first that fits 1 MiB, and times each beside torch's own choice, through
# ctypes, since torch has no way to run a chosen one: whether another algorithm reads a
# decode step's weights faster than the one torch runs. Enum values and struct layouts are
# cublasLt.h's (CUDA 12 and 13 alike). Measured on an H100 (docs/PERFORMANCE.md, session
# 45): another algorithm beat torch's on three products by 3.5-7%, under 1% of either
# step, and the larger workspace only admitted slower splits, so the engine keeps torch's
# choice at torch's workspace.

_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_STAGES_ID = 0, 1, 2, 6
_LT_WORKSPACE_BYTES = 32 << 20


class _LtAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _LtHeuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _LtAlgo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _loaded_library_path(stem: str) -> str | None:
    """The path of a shared library this process has mapped whose file name starts ``stem``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(stem):
                return path
    return None


@functools.cache
def _cublaslt() -> ctypes.CDLL:
    """The cuBLASLt that torch loaded, its functions typed."""
    x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    _cublaslt_linear(x, x)  # torch loads cuBLASLt at its first product there
    path = _loaded_library_path("libcublasLt.so")
    if path is None:
        raise OSError("torch has not loaded libcublasLt")
    lib = ctypes.CDLL(path)
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    u64, i64 = ctypes.c_uint64, ctypes.c_int64
    out = ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "cublasLtCreate": [out],
        "cublasLtMatmulDescCreate": [out, i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [out, i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [out],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [
            p, p, p, p, p, p, p, i, ctypes.POINTER(_LtHeuristic), ctypes.POINTER(i)
        ],
        "cublasLtMatmul": [
            p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_LtAlgo), p, size, p
        ],
        "cublasLtMatmulAlgoConfigGetAttribute": [
            ctypes.POINTER(_LtAlgo), i, p, size, ctypes.POINTER(size)
        ],
    }  # fmt: skip
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, i
    return lib


@functools.cache
def _lt_handle() -> ctypes.c_void_p:
    """One cuBLASLt handle for every product: the stream is given at each call."""
    handle = ctypes.c_void_p()
    _lt_check(_cublaslt().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _lt_workspace() -> torch.Tensor:
    return torch.empty(_LT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def _lt_check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: cublasStatus {status}")


class _LtProduct:
    """``x @ w.T`` of bfloat16 ``x`` [rows, k] and ``w`` [n, k] through cuBLASLt, as torch
    lays it out: column-major ``w.T``'s transpose times ``x.T``, into ``out.T``."""

    def __init__(self, rows: int, n: int, k: int) -> None:
        lib = _cublaslt()
        self.lib, self.rows, self.n = lib, rows, n
        self.handle = _lt_handle()
        self.op = ctypes.c_void_p()
        _lt_check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self.op), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
            "cublasLtMatmulDescCreate",
        )
        for attribute, value in ((_DESC_TRANSA, _CUBLAS_OP_T), (_DESC_TRANSB, _CUBLAS_OP_N)):
            flag = ctypes.c_int32(value)
            status = lib.cublasLtMatmulDescSetAttribute(
                self.op, attribute, ctypes.byref(flag), ctypes.sizeof(flag)
            )
            _lt_check(status, "cublasLtMatmulDescSetAttribute")
        self.a, self.b, self.c = (self._layout(r, c) for r, c in ((k, n), (k, rows), (n, rows)))
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _layout(self, rows: int, cols: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        status = self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _CUDA_R_16BF, rows, cols, rows
        )
        _lt_check(status, "cublasLtMatrixLayoutCreate")
        return layout

    def algorithms(self, count: int, workspace_bytes: int) -> list[_LtHeuristic]:
        """The heuristic's first ``count`` algorithms that fit ``workspace_bytes``, best first."""
        pref = ctypes.c_void_p()
        _lt_check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        _lt_check(
            self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)
            ),
            "PreferenceSetAttribute",
        )
        results = (_LtHeuristic * count)()
        found = ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.op, self.a, self.b, self.c, self.c, pref, count, results,
            ctypes.byref(found),
        )  # fmt: skip
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        _lt_check(status, "cublasLtMatmulAlgoGetHeuristic")
        return [results[j] for j in range(found.value) if results[j].state == 0]

    def config(self, algo: _LtAlgo) -> dict[str, int]:
        """The algorithm's id, tile, split and stages, as cuBLASLt reports them."""
        values = {}
        for name, attribute in (
            ("id", _CONFIG_ID), ("tile", _CONFIG_TILE_ID), ("split_k", _CONFIG_SPLITK_NUM),
            ("stages", _CONFIG_STAGES_ID),
        ):  # fmt: skip
            value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attribute, ctypes.byref(value), 4, ctypes.byref(written)
            )
            values[name] = value.value if status == 0 else -1
        return values

    def run(self, algo: _LtAlgo, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.rows, self.n, device=x.device, dtype=x.dtype)
        status = self.lib.cublasLtMatmul(
            self.handle, self.op, ctypes.byref(self.alpha), w.data_ptr(), self.a,
            x.data_ptr(), self.b, ctypes.byref(self.beta), out.data_ptr(), self.c,
            out.data_ptr(), self.c, ctypes.byref(algo), _lt_workspace().data_ptr(),
            _LT_WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        _lt_check(status, "cublasLtMatmul")
        return out


def compare_lt_algorithms(
    shapes: dict[str, tuple[int, int]], rows: int, count: int, iters: int, bandwidth: float
) -> list[dict]:
    """Each of cuBLASLt's first ``count`` algorithms for the fused layer's products and the
    head at ``rows`` rows, timed as ``time_product`` times torch's own choice beside them."""
    dtype = torch.bfloat16
    print(f"\ncuBLASLt's algorithms (32 MiB offered), batch {rows}")
    results = []
    for name in ("qkv", "o", "gate_up", "down", "lm_head"):
        n, k = shapes[name]
        torch_s = time_product(rows, shapes[name], dtype, iters, _cublaslt_linear)
        product = _LtProduct(rows, n, k)
        within_1mib = [bytes(h.algo) for h in product.algorithms(1, 1 << 20)]
        offered = product.algorithms(count, _LT_WORKSPACE_BYTES)
        print(
            f"{name} ({n} x {k}): torch's cuBLASLt {torch_s * 1e6:.1f} us; "
            f"{len(offered)} algorithms"
        )
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        want = F.linear(x, w).float()
        for rank, heuristic in enumerate(offered):
            config = product.config(heuristic.algo)
            first = bytes(heuristic.algo) in within_1mib
            got = product.run(heuristic.algo, x, w).float()
            error = ((got - want).abs().max() / want.abs().max()).item()
            if error > 2e-2:
                print(f"  #{rank}: wrong result (max error {error:.3g} of the largest value)")
                continue
            seconds = time_product(
                rows, shapes[name], dtype, iters, functools.partial(product.run, heuristic.algo)
            )
            print(
                f"  #{rank}{'*' if first else ' '} {seconds * 1e6:7.1f} us "
                f"{n * k * dtype.itemsize / seconds / bandwidth:5.2f} x copy, "
                f"workspace {heuristic.workspace_size / 2**20:5.2f} MiB, waves "
                f"{heuristic.waves_count:5.2f}, {config}"
            )
            results.append(
                {"batch": rows, "product": name, "rank": rank, "seconds": seconds,
                 "torch_cublaslt_seconds": torch_s, "workspace": heuristic.workspace_size,
                 "first_within_1mib": first, **config}
            )  # fmt: skip
    print("(#0: the heuristic's first within 32 MiB; *: its first within 1 MiB)")
    return results


def compare_candidate(
    shapes: dict[str, tuple[int, int]], rows: int, dtype: torch.dtype, iters: int
) -> list[dict]:
    """Best candidate configuration per product at ``rows`` rows, against cuBLAS(Lt)."""
    print(f"\ntiled split-K Triton candidate against cuBLAS, batch {rows}")
    print(
        f"{'product':>8} {'GFLOP':>6} {'cuBLAS us':>9} {'TFLOP/s':>7} {'Lt us':>7} "
        f"{'cand. us':>8} {'TFLOP/s':>7} {'no reduce':>9}  best configuration"
    )
    results = []
    layer = {"cublas": 0.0, "cublaslt": 0.0, "best": 0.0}
    for name in ("qkv", "o", "down"):
        shape = shapes[name]
        flops = 2 * rows * shape[0] * shape[1]
        cublas = time_product(rows, shape, dtype, iters)
        cublaslt = time_product(rows, shape, dtype, iters, _cublaslt_linear)
        x = torch.randn(rows, shape[1], device="cuda", dtype=dtype)
        w = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
        want = F.linear(x, w)
        timed = []
        for config in candidate_configs(rows, shape[1]):
            product = functools.partial(tiled_split_k_linear, **config)
            try:
                torch.testing.assert_close(product(x, w), want, rtol=2e-2, atol=2e-2)
            except Exception as exc:  # a configuration Triton cannot build here
                print(f"  skipped {config}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            seconds = time_product(rows, shape, dtype, max(5, iters // 4), product)
            timed.append((seconds, config))
            results.append(
                {"batch": rows, "product": name, "seconds": seconds, "flops": flops, **config}
            )
        timed.sort(key=lambda item: item[0])
        seconds, config = timed[0]
        unreduced = time_product(
            rows, shape, dtype, max(5, iters // 4),
            functools.partial(tiled_split_k_linear, reduce=False, **config),
        )  # fmt: skip
        print(
            f"{name:>8} {flops / 1e9:>6.2f} {cublas * 1e6:>9.1f} {flops / cublas / 1e12:>7.0f} "
            f"{cublaslt * 1e6:>7.1f} {seconds * 1e6:>8.1f} {flops / seconds / 1e12:>7.0f} "
            f"{unreduced * 1e6:>9.1f}  {config}"
        )
        for runner_up, runner_config in timed[1:4]:
            print(f"{'':>60}{runner_up * 1e6:>8.1f} us  {runner_config}")
        results.append(
            {"batch": rows, "product": name, "cublas_s": cublas, "cublaslt_s": cublaslt,
             "best_s": seconds, "best_unreduced_s": unreduced, "best": config}
        )  # fmt: skip
        layer["cublas"] += cublas
        layer["cublaslt"] += cublaslt
        layer["best"] += min(cublas, cublaslt, seconds)
    print(
        f"the three products: cuBLAS {layer['cublas'] * 1e6:.1f} us, cuBLASLt "
        f"{layer['cublaslt'] * 1e6:.1f} us, the fastest of the three each "
        f"{layer['best'] * 1e6:.1f} us"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--candidate", action="store_true", help="also sweep the tiled split-K Triton kernel"
    )
    parser.add_argument("--only-candidate", action="store_true", help="the candidate's sweep alone")
    parser.add_argument("--self-check", action="store_true", help="check the candidate, exit")
    parser.add_argument(
        "--lt-algos",
        type=int,
        default=0,
        metavar="N",
        help="also time cuBLASLt's first N algorithms for each product (32 MiB workspace)",
    )
    args = parser.parse_args(argv)
    if args.self_check:
        self_check()
        return 0
    if not torch.cuda.is_available():
        print("bench_matmul needs a CUDA device", file=sys.stderr)
        return 2

    from cbpipe.models import resolve_model
    from cbpipe.roofline import copy_bandwidth

    dtype = torch.bfloat16
    config = resolve_model(args.model).config
    bandwidth = copy_bandwidth(torch.device("cuda"))
    shapes = projection_shapes(config)
    print(
        f"{args.model}, bf16, {torch.cuda.get_device_name()}, copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s, torch {torch.__version__}"
    )
    results = []
    for rows in [] if args.only_candidate else args.batch:
        print(f"\nbatch {rows}")
        print(
            f"{'product':>8} {'out x in':>14} {'MB':>7} {'us':>8} {'GB/s':>7} {'x copy':>7} "
            f"{'Lt us':>7} {'x copy':>7}"
        )
        times = {}
        for name, shape in shapes.items():
            seconds = time_product(rows, shape, dtype, args.iters)
            lt_seconds = time_product(rows, shape, dtype, args.iters, _cublaslt_linear)
            nbytes = shape[0] * shape[1] * dtype.itemsize
            times[name] = seconds
            rate = nbytes / seconds
            print(
                f"{name:>8} {shape[0]:>6} x {shape[1]:<6} {nbytes / 2**20:>7.1f} "
                f"{seconds * 1e6:>8.1f} {rate / 1e9:>7.0f} {rate / bandwidth:>7.2f} "
                f"{lt_seconds * 1e6:>7.1f} {nbytes / lt_seconds / bandwidth:>7.2f}"
            )
            results.append(
                {
                    "batch": rows,
                    "product": name,
                    "shape": shape,
                    "seconds": seconds,
                    "cublaslt_seconds": lt_seconds,
                    "bytes": nbytes,
                    "bytes_per_second": rate,
                }
            )
        layers = config.get_text_config().num_hidden_layers
        separate = sum(times[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        fused = sum(times[n] for n in ("qkv", "o", "gate_up", "down"))
        layer_bytes = sum(shapes[n][0] * shapes[n][1] for n in ("qkv", "o", "gate_up", "down"))
        floor = layer_bytes * dtype.itemsize / bandwidth
        print(
            f"one layer: separate {separate * 1e6:.1f} us, fused {fused * 1e6:.1f} us, "
            f"at the copy rate {floor * 1e6:.1f} us; x{layers} layers + head: separate "
            f"{(separate * layers + times['lm_head']) * 1e3:.2f} ms, fused "
            f"{(fused * layers + times['lm_head']) * 1e3:.2f} ms"
        )
    if args.lt_algos:
        for rows in args.batch:
            found = compare_lt_algorithms(shapes, rows, args.lt_algos, args.iters, bandwidth)
            results.extend(found)
    if args.candidate or args.only_candidate:
        for rows in args.batch:
            results.extend(compare_candidate(shapes, rows, dtype, args.iters))
    if args.json:
        with open(args.json, "w") as f:
            summary = {"model": args.model, "copy_bandwidth": bandwidth, "results": results}
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
