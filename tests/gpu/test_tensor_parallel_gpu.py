"""Tensor parallelism on NCCL: the sharded layers' collectives compiled and captured on one
GPU, and on two GPUs (bfloat16, decode from CUDA graphs) the same requests at
``--tensor-parallel-size`` 2 and 1, on one checkpoint of Llama-3-8B's shape.

The random preset is not used directly: at size 2 a preset materialises only each rank's
shard, from a random stream that follows the shard shapes, so its weights are not size 1's.
A checkpoint folder written once gives both sizes the same weights. In bfloat16 the two
sizes sum the row-parallel products in another order (two partial products and an
all-reduce), so tokens may part at near-ties; the test prints how many requests match
exactly and asks that most agree on their first ``PREFIX`` tokens. Run by
``scripts/gpu_check.sh`` (PARTS=tp) on a machine with two GPUs; the one-GPU case runs wherever
there is a GPU.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess
from cbpipe.protocol.launch import Rendezvous
from cbpipe.worker.compiling import compile_decode_fn, decode_compile_settings
from cbpipe.worker.tensor_parallel import GatheredLinear, RowParallelLinear, TensorParallel

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

NUM_REQUESTS = 32
PROMPT_LEN = 128
MAX_NEW_TOKENS = 64
PREFIX = 8
START_TIMEOUT_S = 600.0


class _Layer(nn.Module):
    """A decode layer's shape of collectives: a row-parallel product (o, down) between
    local work, compiled as the decoder layers are."""

    def __init__(self, tp: TensorParallel, width: int) -> None:
        super().__init__()
        linear = nn.Linear(width, width, bias=True, device="cuda", dtype=torch.bfloat16)
        self.down = RowParallelLinear(linear, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_collectives_compile_and_capture_on_one_rank() -> None:
    """NCCL at one rank, through the calls two ranks make: the group joined as a worker rank
    joins it, the row-parallel all-reduce traced by dynamo inside a compiled layer and the
    head's all-gather run eagerly, both captured in one CUDA graph; replays with new inputs
    give the eager result. One rank sums nothing: what this checks is the torch version's
    collective API, dynamo's handling of the in-place all-reduce and NCCL under capture."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    device = torch.device("cuda", 0)
    tp = TensorParallel.join(Rendezvous("127.0.0.1", port, 1), 0, device)
    try:
        torch.manual_seed(0)
        width, vocab = 256, 1024
        layer = _Layer(tp, width)
        head = GatheredLinear(
            nn.Linear(width, vocab, bias=False, device=device, dtype=torch.bfloat16), tp
        )
        compiled = compile_decode_fn(layer)

        def step(x: torch.Tensor) -> torch.Tensor:
            return head(compiled(x))

        def eager(x: torch.Tensor) -> torch.Tensor:
            return head(layer(x))

        static = torch.randn(8, width, device=device, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with decode_compile_settings():
            step(static)  # compiles outside the capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step(static)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                out = step(static)
        for seed in range(3):
            static.copy_(torch.randn(8, width, generator=torch.Generator().manual_seed(seed))
                         .to(device, torch.bfloat16))  # fmt: skip
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, eager(static), rtol=2e-2, atol=2e-2)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama8b_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """random:llama-8b's weights (seeded, made on GPU 0) saved as a checkpoint folder."""
    from transformers import AutoModelForCausalLM

    from cbpipe.models import resolve_model

    folder = tmp_path_factory.mktemp("tp") / "llama8b"
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(
            resolve_model("random:llama-8b").config, dtype=torch.bfloat16
        )
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    yield folder


def _tokens(folder: Path, size: int, prompts: list[list[int]], *extra: str) -> list[list[int]]:
    flags = ["--model", str(folder), "--device", "cuda", "--dtype", "bfloat16",
             "--tensor-parallel-size", str(size), *extra]  # fmt: skip
    engine = EngineProcess.spawn(flags)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        with Client(engine.address) as client:
            results = client.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        return [r.token_ids for r in results]
    finally:
        engine.stop()


@needs_two_gpus
@pytest.mark.parametrize("extra", [("--no-compile-decode",), ()], ids=["graphs", "compiled"])
def test_size_2_matches_size_1_in_bfloat16(llama8b_folder: Path, extra: tuple[str, ...]) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(PROMPT_LEN)] for _ in range(32)]
    one = _tokens(llama8b_folder, 1, prompts, *extra)
    two = _tokens(llama8b_folder, 2, prompts, *extra)
    exact = sum(a == b for a, b in zip(one, two, strict=True))
    prefix = sum(a[:PREFIX] == b[:PREFIX] for a, b in zip(one, two, strict=True))
    parts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(one, two, strict=True)]  # fmt: skip
    print(
        f"\nTP=2 vs TP=1, bfloat16 {' '.join(extra) or 'graphs'}: {exact} of {len(prompts)} "
        f"requests match exactly, {prefix} in their first {PREFIX} tokens; first differences "
        f"at {parts}"
    )
    assert prefix >= 0.75 * len(prompts)
