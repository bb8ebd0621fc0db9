"""Train the tiny default model embedded in ``cbpipe/models/default``.

The model is a deliberately small Llama (4 layers, hidden size 128, grouped-query attention)
trained for a few minutes on CPU. It is not meant to be useful: it only has to be a real
Hugging Face checkpoint that loads offline, produces English-like text and stops at EOS, so
that the engine, its tests and its demos have something to run without downloading weights.

Everything is built at run time from text already present on any machine with Python:

1. Corpus: the docstrings of a fixed, sorted list of standard-library modules and of their
   classes, methods and functions, with whitespace normalised and duplicates removed. Each
   docstring is one document and ends with the EOS token.
2. Tokenizer: a byte-level BPE (vocabulary 2048) trained with ``tokenizers`` and wrapped as a
   ``transformers.PreTrainedTokenizerFast``. No BOS token is added when encoding.
3. Model: ``LlamaForCausalLM`` trained in float32 with AdamW, linear warmup and cosine decay,
   on packed sequences of 256 tokens, with fixed seeds and a fixed data order.

Run it (about 7 minutes on 2 otherwise idle CPU cores; the default output is
``cbpipe/models/default`` inside the repository, wherever it is run from)::

    python scripts/train_default_model.py
    python scripts/train_default_model.py --output /tmp/model --steps 50   # quick smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import math
import pkgutil
import random
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SEED = 0
NUM_THREADS = 2
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "cbpipe" / "models" / "default"
DEFAULT_STEPS = 600

VOCAB_SIZE = 2048
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

SEQ_LEN = 256
BATCH_SIZE = 32
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VAL_FRACTION = 0.02
LOG_EVERY = 25

MIN_DOC_CHARS = 20
SAMPLE_PROMPTS = ("Return the", "The list of")
SAMPLE_NEW_TOKENS = 60

# Standard-library modules whose docstrings form the corpus; packages are walked recursively
# (in name order) for their submodules. The list is fixed and sorted so the corpus does not
# depend on what else is installed. It leaves out modules with import-time side effects
# (antigravity, this, idlelib, tkinter, turtle, turtledemo, readline), installers (ensurepip,
# venv), the test suite, the codec registry (encodings), and modules deprecated or removed in
# recent Pythons. Modules that fail to import on a platform (e.g. fcntl on Windows) are skipped.
STDLIB_MODULE_NAMES = """
    abc argparse array ast asyncio atexit base64 bdb binascii bisect builtins bz2 cProfile
    calendar cmath cmd code codecs codeop collections colorsys compileall concurrent
    configparser contextlib contextvars copy copyreg csv ctypes curses dataclasses datetime dbm
    decimal difflib dis doctest email enum errno faulthandler fcntl filecmp fileinput fnmatch
    fractions ftplib functools gc getopt getpass gettext glob graphlib grp gzip hashlib heapq
    hmac html http imaplib importlib inspect io ipaddress itertools json keyword linecache
    locale logging lzma mailbox marshal math mimetypes mmap modulefinder multiprocessing netrc
    numbers opcode operator optparse os pathlib pdb pickle pickletools pkgutil platform plistlib
    poplib posixpath pprint profile pstats pty pwd py_compile pyclbr pydoc queue quopri random
    re reprlib resource rlcompleter runpy sched secrets select selectors shelve shlex shutil
    signal smtplib socket socketserver sqlite3 ssl stat statistics string stringprep struct
    subprocess symtable sys sysconfig syslog tabnanny tarfile tempfile termios textwrap
    threading time timeit token tokenize tomllib trace traceback tracemalloc tty types typing
    unicodedata unittest urllib uuid warnings wave weakref webbrowser wsgiref xml xmlrpc zipapp
    zipfile zipimport zlib zoneinfo
"""
STDLIB_MODULES: tuple[str, ...] = tuple(STDLIB_MODULE_NAMES.split())
# Submodules never walked into: test packages and ``python -m`` entry points.
SKIPPED_SUBMODULES = frozenset({"__main__", "idle_test", "test", "tests"})


def log(message: str) -> None:
    """Print a progress line immediately."""
    print(message, flush=True)


def seed_everything(seed: int) -> None:
    """Fix every random source the script uses and pin the thread count."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def import_quietly(name: str) -> ModuleType | None:
    """Import a module with its output suppressed; ``None`` if it fails to import."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def walk_modules(names: tuple[str, ...]) -> Iterator[ModuleType]:
    """Import the named modules in sorted order, each package followed by its submodules."""
    seen: set[str] = set()
    pending = sorted(names, reverse=True)
    while pending:
        name = pending.pop()
        module = import_quietly(name)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        yield module
        if hasattr(module, "__path__"):
            children = sorted(
                f"{name}.{info.name}"
                for info in pkgutil.iter_modules(module.__path__)
                if info.name not in SKIPPED_SUBMODULES
            )
            pending.extend(reversed(children))


def own_doc(obj: object) -> str | None:
    """The object's own docstring (not one inherited from a base class), if it is a string."""
    try:
        doc = obj.__doc__
    except Exception:
        return None
    return doc if isinstance(doc, str) else None


def class_members(cls: type) -> Iterator[object]:
    """Routines and properties defined directly on a class, by name (dunders except __init__)."""
    for name, value in sorted(vars(cls).items()):
        if name.startswith("__") and name != "__init__":
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isroutine(value) or isinstance(value, property):
            yield value


def module_objects(module: ModuleType) -> Iterator[object]:
    """The module, then its classes (each with its members) and routines, by name."""
    yield module
    for name, value in sorted(vars(module).items()):
        if name.startswith("__"):
            continue
        if inspect.isclass(value):
            yield value
            yield from class_members(value)
        elif inspect.isroutine(value):
            yield value


def normalise(doc: str) -> str:
    """Collapse every run of whitespace (newlines included) to one space."""
    return re.sub(r"\s+", " ", doc).strip()


def build_corpus(module_names: tuple[str, ...]) -> list[str]:
    """Deduplicated, normalised docstrings of the given modules, in a deterministic order."""
    if sys.flags.optimize >= 2:
        raise SystemExit("docstrings are stripped under python -OO; run without -OO")
    seen: set[str] = set()
    documents: list[str] = []
    modules = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in walk_modules(module_names):
            modules += 1
            for obj in module_objects(module):
                doc = own_doc(obj)
                text = normalise(doc) if doc else ""
                if len(text) >= MIN_DOC_CHARS and text not in seen:
                    seen.add(text)
                    documents.append(text)
    chars = sum(len(doc) for doc in documents)
    log(f"corpus: {len(documents)} docstrings, {chars:,} chars from {modules} modules")
    return documents


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the documents and wrap it for ``transformers``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens")
    return tokenizer


def encode_corpus(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> torch.Tensor:
    """One long token stream: every document followed by EOS."""
    eos_id = tokenizer.eos_token_id
    stream: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(documents):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    log(f"tokens: {len(stream):,} ({sum(map(len, documents)) / len(stream):.2f} chars/token)")
    return torch.tensor(stream, dtype=torch.long)


def split_sequences(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the stream into packed sequences and hold out a fixed, shuffled validation share."""
    count = stream.numel() // seq_len
    sequences = stream[: count * seq_len].view(count, seq_len)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(SEED))
    n_val = max(1, int(count * VAL_FRACTION))
    return sequences[order[n_val:]], sequences[order[:n_val]]


def batches(sequences: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches: one seeded permutation of the sequences per epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(sequences.size(0), generator=generator)
        for start in range(0, order.numel() - batch_size + 1, batch_size):
            yield sequences[order[start : start + batch_size]]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A 4-layer Llama with grouped-query attention and tied embeddings, in float32."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    params = sum(p.numel() for p in model.parameters())
    log(f"model: LlamaForCausalLM, {params:,} parameters")
    return model


def learning_rate(step: int, total_steps: int) -> float:
    """Linear warmup to ``PEAK_LR``, then cosine decay to ``MIN_LR_RATIO * PEAK_LR``."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return PEAK_LR * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine)


def make_optimizer(model: LlamaForCausalLM) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95))


def train_step(
    model: LlamaForCausalLM, optimizer: torch.optim.AdamW, batch: torch.Tensor, lr: float
) -> float:
    """One optimisation step on a batch; returns the loss in nats per token."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, sequences: torch.Tensor) -> float:
    """Mean loss over the validation sequences."""
    model.eval()
    losses = [
        model(input_ids=chunk, labels=chunk).loss.item() for chunk in sequences.split(BATCH_SIZE)
    ]
    model.train()
    return sum(losses) / len(losses)


def train(
    model: LlamaForCausalLM, train_seqs: torch.Tensor, val_seqs: torch.Tensor, steps: int
) -> float:
    """Train for ``steps`` steps, printing progress; returns the final validation loss."""
    optimizer = make_optimizer(model)
    data = batches(train_seqs, BATCH_SIZE, SEED)
    model.train()
    start = time.perf_counter()
    running = 0.0
    for step in range(steps):
        loss = train_step(model, optimizer, next(data), learning_rate(step, steps))
        running = loss if step == 0 else 0.9 * running + 0.1 * loss
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            log(
                f"step {step + 1:5d}/{steps}  loss {running:.3f}  "
                f"lr {learning_rate(step, steps):.2e}  {elapsed:6.1f}s"
            )
    val_loss = evaluate(model, val_seqs)
    log(f"training: {steps} steps in {time.perf_counter() - start:.1f}s, val loss {val_loss:.3f}")
    return val_loss


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_sample(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """Greedy continuation of ``prompt``, decoded without special tokens."""
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, do_sample=False, max_new_tokens=SAMPLE_NEW_TOKENS)
    return tokenizer.batch_decode(output, skip_special_tokens=True)[0]


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, output: Path) -> None:
    """Write the checkpoint (float32 safetensors) and tokenizer files to ``output``."""
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    log(f"saved to {output} ({size / 1e6:.2f} MB)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description="Train the embedded default model.")
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="checkpoint folder to write"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="number of optimisation steps"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the corpus and tokenizer, train the model, save it and print samples."""
    args = parse_args(argv)
    start = time.perf_counter()
    seed_everything(SEED)
    documents = build_corpus(STDLIB_MODULES)
    tokenizer = train_tokenizer(documents, VOCAB_SIZE)
    train_seqs, val_seqs = split_sequences(encode_corpus(tokenizer, documents), SEQ_LEN)
    log(f"sequences: {train_seqs.size(0)} train, {val_seqs.size(0)} validation of {SEQ_LEN}")
    model = build_model(tokenizer)
    train(model, train_seqs, val_seqs, args.steps)
    save(model, tokenizer, args.output)
    for prompt in SAMPLE_PROMPTS:
        log(f"sample: {greedy_sample(model, tokenizer, prompt)!r}")
    log(f"done in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
