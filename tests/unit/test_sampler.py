import pytest
import torch

from cbpipe.worker import sampler
from cbpipe.worker.sampler import SamplingInputs, sample
from tests.unit.triton_interpreter import needs_cuda


def inputs(
    n: int,
    temperature: float = 1.0,
    seeds: torch.Tensor | None = None,
    output_index: int = 0,
) -> SamplingInputs:
    return SamplingInputs(
        temperature=torch.full((n,), temperature),
        seed=seeds if seeds is not None else torch.arange(n),
        output_index=torch.full((n,), output_index, dtype=torch.int32),
        all_greedy=temperature == 0,
    )


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5]).repeat(20000, 1)
    ids, logprobs = sample(logits, inputs(20000))
    frequencies = torch.bincount(ids, minlength=4) / 20000
    assert torch.allclose(frequencies, logits[0].softmax(-1), atol=0.015)
    assert torch.allclose(logprobs, logits[0].log_softmax(-1)[ids])


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = torch.randn(6, 50)
    mixed = inputs(6)
    mixed.temperature[::2] = 0.0
    ids, _ = sample(logits, mixed)
    assert torch.equal(ids[::2], logits[::2].argmax(-1))


def test_a_seeded_draw_depends_on_seed_and_index_only() -> None:
    logits = torch.randn(1, 300).repeat(8, 1)
    seeds = torch.tensor([5, 5, 5, 5, 6, 6, 6, 6])
    first, _ = sample(logits, inputs(8, seeds=seeds, output_index=3))
    assert len(set(first[:4].tolist())) == 1 and len(set(first[4:].tolist())) == 1
    crowd = torch.cat([torch.randn(5, 300), logits[:1]])
    alone, _ = sample(crowd, inputs(6, seeds=torch.tensor([1, 2, 3, 4, 9, 5]), output_index=3))
    assert alone[-1] == first[0]
    later, _ = sample(logits, inputs(8, seeds=torch.arange(8), output_index=4))
    earlier, _ = sample(logits, inputs(8, seeds=torch.arange(8), output_index=3))
    assert not torch.equal(later, earlier)


@pytest.mark.parametrize("max_pieces", [64, 128])
def test_greedy_takes_the_first_maximum_across_the_vocabulary_pieces(
    monkeypatch: pytest.MonkeyPatch, max_pieces: int
) -> None:
    monkeypatch.setattr(sampler, "_MAX_PIECES", max_pieces)
    monkeypatch.setattr(sampler, "_MIN_PIECE", 512)
    # 128256 = Llama 3's vocabulary, in 64 or 128 pieces; 7919 is prime, one piece.
    for vocab in (128256, 7919, 50):
        logits = torch.randn(5, vocab)
        logits[1, [3, vocab - 1]] = 100.0  # a tie in the first and last piece
        logits[2, [vocab // 2 + 1, vocab - 2]] = 100.0  # a tie inside later pieces
        logits[3] = 0.0  # all tied: the first token
        ids, logprobs = sample(logits, inputs(5, temperature=0.0))
        assert torch.equal(ids, logits.argmax(-1))
        expected = logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0]
        assert torch.allclose(logprobs, expected, atol=1e-5)


def test_log_probabilities_survive_a_piece_of_minus_infinity() -> None:
    logits = torch.randn(3, 4096)  # 4 pieces of 1024
    logits[:, :1024] = float("-inf")
    logits[1, 2048:] = float("-inf")
    for temperature in (0.0, 1.0):
        ids, logprobs = sample(logits, inputs(3, temperature=temperature))
        assert bool((ids >= 1024).all())
        expected = logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0]
        assert torch.allclose(logprobs, expected, atol=1e-5)


def _uniform_int64(seed: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draws as first written: every step of the hash in int64, masked to 32 bits."""
    mask = 0xFFFFFFFF

    def mix(x: torch.Tensor) -> torch.Tensor:
        x = x ^ (x >> 16)
        x = (x * sampler._MUL1) & mask
        x = x ^ (x >> 15)
        x = (x * sampler._MUL2) & mask
        return x ^ (x >> 16)

    seed = seed.long()
    key = mix((seed & mask) ^ mix((seed >> 32) & mask))
    key = mix(key ^ mix(output_index.long() & mask))
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    x = mix(key[:, None] ^ ((token * sampler._TOKEN_MUL) & mask)[None, :])
    x = mix(x ^ key[:, None])
    return ((x >> 9).float() + 0.5) / float(1 << 23)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])],
)
def test_the_draws_in_int32_are_the_int64_hash_bit_for_bit(device: str) -> None:
    """The per-token hash runs in int32 (wrapping products, masked shifts) for speed; a
    seeded request's tokens are fixed by the int64 definition, on every device, eager and
    compiled. Seeds across the whole int64 range (negative ones, whose high word has its top
    bit set) and output indices whose keys land on both sides of 2**31."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (96,), generator=gen),
            torch.tensor([0, 1, -1, 121, 2**63 - 1, -(2**63), 2**32 - 1, 2**31]),
        ]
    ).to(device)
    index = torch.randint(0, 2**31 - 1, (seeds.numel(),), generator=gen, dtype=torch.int32)
    index = index.to(device)
    want = _uniform_int64(seeds, index, 128_256)
    assert torch.equal(sampler._uniform(seeds, index, 128_256), want)
    compiled = torch.compile(sampler._uniform, dynamic=True)
    assert torch.equal(compiled(seeds, index, 128_256), want)


def test_the_uniform_draws_never_reach_0_or_1() -> None:
    """A draw of exactly 1 is Gumbel noise of +inf: its token wins whatever its logit, -inf
    (masked, banned, cut by top-k or top-p) included. Seed 121's draw for output 9 over the
    embedded model's 2048 tokens reached 1 at token 1107 when the draws had 24 bits."""
    u = sampler._uniform(torch.tensor([121]), torch.tensor([9]), 2048)
    assert float(u.min()) > 0 and float(u.max()) < 1
    seeds = torch.arange(4096, dtype=torch.int64)
    u = sampler._uniform(seeds, torch.arange(4096, dtype=torch.int32) % 97, 2048)
    assert float(u.min()) > 0 and float(u.max()) < 1  # 8 M draws
    logits = torch.zeros(1, 2048)
    logits[0, 1107] = float("-inf")  # banned
    inputs = SamplingInputs(
        temperature=torch.tensor([1.0]),
        seed=torch.tensor([121]),
        output_index=torch.tensor([9], dtype=torch.int32),
        all_greedy=False,
    )
    ids, _ = sample(logits, inputs)
    assert int(ids[0]) != 1107
