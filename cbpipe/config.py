"""Engine settings: one frozen dataclass tree, and the launcher flags generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from cbpipe import env

DEFAULT_MODEL = "default"
# The per-step limits when --max-batch-tokens and --max-num-seqs are unset, by the device's
# memory: vLLM's API-server defaults, which a user moving from it expects. On a large GPU a
# burst of prompts is prefilled several times sooner in steps of 8,192 tokens, at the price of
# a longer gap between tokens for the sequences running beside a long prefill; and a burst of
# requests finishes sooner, and sees its first tokens sooner, 1,024 sequences at a time
# (docs/PERFORMANCE.md).
BATCH_TOKENS = 2048
LARGE_DEVICE_BATCH_TOKENS = 8192
NUM_SEQS = 256
LARGE_DEVICE_NUM_SEQS = 1024
LARGE_DEVICE_MEMORY = 70 << 30  # bytes: an H100, H200 or MI300X, not a 40 GB A100


def _opt(default: Any, help: str, *, secret: bool = False) -> Any:
    """A setting and its flag's help; a secret one stays out of ``repr`` (and logs)."""
    return field(default=default, repr=not secret, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt(
        DEFAULT_MODEL,
        "a Hugging Face Hub id (downloaded into the Hugging Face cache unless there), a "
        "local checkpoint folder, 'default' (the embedded tiny model) or a random-weight "
        "preset such as 'random:llama-1b'",
    )
    revision: str | None = _opt(
        None, "the branch, tag or commit of a --model Hub id (default: its main branch)"
    )
    tokenizer: str | None = _opt(
        None,
        "a folder holding the tokenizer to use instead of the model's own (vLLM's "
        "--tokenizer): text prompts, chat templates and structured output for a checkpoint "
        "without one, or a random-weight preset",
    )
    device: Literal["auto", "cpu", "cuda"] = _opt("auto", "where the worker runs the model")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "model and KV-cache dtype; auto is float32 on the CPU, bfloat16 on CUDA"
    )
    max_model_len: int | None = _opt(
        None, "longest sequence (prompt + output) served; default: the model's own limit"
    )
    seed: int = _opt(0, "seed for random-weight presets")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV-cache block")
    num_blocks: int | None = _opt(
        None, "KV-cache blocks; default: sized from the memory left on the device"
    )
    kv_cache_memory_fraction: float = _opt(
        0.85, "share of the device memory left after loading the model that the KV cache takes"
    )
    cpu_kv_cache_gib: float = _opt(
        1.0, "KV-cache size on the CPU device when --num-blocks is unset"
    )
    prefix_caching: bool = _opt(
        True,
        "reuse the KV blocks of prompt prefixes computed before (a shared system prompt, a "
        "conversation's history, n samples); --no-prefix-caching computes every prompt whole",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = _opt(
        None,
        f"most sequences in one step; default: {LARGE_DEVICE_NUM_SEQS} on a GPU of "
        f"{LARGE_DEVICE_MEMORY >> 30} GiB or more, {NUM_SEQS} elsewhere, and no more than "
        f"--max-batch-tokens",
    )
    max_batch_tokens: int | None = _opt(
        None,
        f"most tokens (prefill chunks + decodes) in one step; default: "
        f"{LARGE_DEVICE_BATCH_TOKENS} on a GPU of {LARGE_DEVICE_MEMORY >> 30} GiB or more, "
        f"{BATCH_TOKENS} elsewhere (larger steps finish prompts sooner; the sequences running "
        f"beside a prefill wait the whole step for their next token)",
    )
    sync: bool = _opt(False, "wait for each step's tokens before packing the next")
    steps_in_flight: int = _opt(
        3,
        "steps sent to the worker and not yet answered, in async mode: 2 packs step N+1 while "
        "N runs; 3 also sends N+2, so the round trip of N's tokens to the scheduler and of the "
        "next step back hides behind two device steps instead of one (--sync is 1)",
    )
    debug_scheduler_delay_ms: float = _opt(
        0.0, "add this much CPU time to every step's packing (to show what asynchrony hides)"
    )
    trace: str | None = _opt(
        None, "write a Chrome/Perfetto trace of every step's CPU phases and GPU span here"
    )
    step_timeout_s: float = _opt(
        10.0,
        "a step the worker has not finished after this long, or after 20 times what the "
        "recent steps took scaled to its rows if that is longer, fails the engine (a hung "
        "device)",
    )
    max_waiting_requests: int = _opt(
        65536, "requests queued beyond this are refused as busy (clients get EngineBusy)"
    )

    @property
    def max_in_flight(self) -> int:
        """Steps sent and not yet answered: one in sync mode."""
        return 1 if self.sync else self.steps_in_flight

    def num_seqs(self, device_memory: int | None) -> int:
        """The most sequences a step holds on a device of ``device_memory`` bytes (None: the
        CPU): ``max_num_seqs`` when given, else the default for the device, and no more than
        a given token budget has rows for."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        default = LARGE_DEVICE_NUM_SEQS if _is_large(device_memory) else NUM_SEQS
        return default if self.max_batch_tokens is None else min(default, self.max_batch_tokens)

    def batch_tokens(self, device_memory: int | None) -> int:
        """The per-step token budget on a device of ``device_memory`` bytes (None: the CPU):
        ``max_batch_tokens`` when given, else the default for the device, and a row for every
        sequence at least."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        default = LARGE_DEVICE_BATCH_TOKENS if _is_large(device_memory) else BATCH_TOKENS
        return max(default, self.num_seqs(device_memory))


def _is_large(device_memory: int | None) -> bool:
    return device_memory is not None and device_memory >= LARGE_DEVICE_MEMORY


@dataclass(frozen=True)
class WorkerConfig:
    attention_backend: Literal["auto", "triton", "torch"] = _opt(
        "auto",
        "decode attention: a Triton paged kernel, or plain torch (gather pages, then SDPA); "
        "auto is triton on CUDA when it imports, torch elsewhere",
    )
    prefill_attention_backend: Literal["auto", "triton", "torch"] = _opt(
        "auto",
        "prefill rows: a Triton varlen paged kernel, or plain torch (gather pages, then SDPA); "
        "auto is triton on CUDA when it imports, torch elsewhere",
    )
    fuse_projections: bool = _opt(
        True,
        "one matrix product for q|k|v and one for gate|up (small products read their weights "
        "well below the memory bandwidth)",
    )
    cuda_graphs: bool = _opt(
        True,
        "replay decode steps from CUDA graphs captured at start-up, one per batch-size bucket "
        "and slot (CUDA with the triton backend only; --no-cuda-graphs runs every step eagerly)",
    )
    compile_decode: bool = _opt(
        True,
        "torch.compile the forward that decode graphs capture (CUDA graphs only): fuses the "
        "norms, rotary embeddings and activations between the matrix products; the first "
        "start-up of a model compiles, later ones read the compile cache "
        "(--no-compile-decode: graphs of the eager forward, a shorter cold start-up)",
    )
    saved_traces: bool = _opt(
        True,
        "keep the compiled samplers' whole traces (torch's experimental aot_compile) in the "
        "compile cache, so that a later start-up loads them instead of tracing them again "
        "(--no-saved-traces: trace them at every start-up)",
    )
    blas_library: Literal["auto", "cublaslt", "cublas"] = _opt(
        "auto",
        "the BLAS library of the matrix products on CUDA; auto is cuBLASLt (its kernels for "
        "a decode step's small products need no separate split-K reductions) where this "
        "torch has it, else cuBLAS; cublaslt or cublas: that one",
    )
    max_graph_batch: int | None = _opt(
        None, "largest decode batch captured in a graph; default: --max-num-seqs"
    )
    mixed_graph_tokens: int = _opt(
        1024,
        "with CUDA graphs and the Triton kernels, also replay mixed steps (decodes beside "
        "prefill chunks of new prompts) of up to this many tokens from graphs, in buckets of "
        "32-128 tokens; eagerly such a step's launches take longer than its kernels "
        "(0: mixed steps run eagerly)",
    )
    tensor_parallel_size: int = _opt(
        1,
        "worker ranks the model is sharded over (heads and MLP columns split, torch.distributed "
        "between them: NCCL on CUDA, one GPU a rank; gloo on the CPU); 1 runs one worker "
        "process without torch.distributed",
    )
    compile_cache_dir: str | None = _opt(
        None,
        "where compiled kernels (inductor's and Triton's) are kept between launches, in a "
        "folder per model, dtype, device and library versions; default: $CBPIPE_CACHE_DIR, "
        "else ~/.cache/cbpipe; 'off': the libraries' own defaults",
    )


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP front end (``cbpipe/server/``)."""

    port: int | None = _opt(
        None,
        "serve the OpenAI-compatible HTTP API on this port (0: any free one); "
        "default: no HTTP server",
    )
    host: str = _opt("127.0.0.1", "address the HTTP server binds (0.0.0.0: every interface)")
    api_server_count: int | None = _opt(
        None,
        "HTTP server processes, sharing the port; default: one per 4 host cores, 1 to 4 "
        "(one process streamed 42,000 tokens/s on an H200, four 56,900)",
    )
    served_model_name: str | None = _opt(
        None, "the model's name in the HTTP API; default: the --model value"
    )
    chat_template: str | None = _opt(
        None,
        "a Jinja chat template instead of the tokenizer's: a file, or the template's text (a "
        "value without '{', '}' or a newline must name a file); checked at launch",
    )
    enable_auto_tool_choice: bool = _opt(
        False,
        "find tool calls in chat replies (requests with tools and tool_choice auto, the "
        "default once tools are given); needs --tool-call-parser",
    )
    tool_call_parser: str | None = _opt(
        None,
        "how the model writes tool calls: 'hermes' (<tool_call> blocks: Hermes, Qwen 2.5 and "
        "3) or 'llama3_json' (a reply of JSON calls: Llama 3.1 and 3.2)",
    )
    generation_config: str = _opt(
        "auto",
        "sampling defaults for requests that leave a field out: 'auto' takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and "
        "max_new_tokens as max_tokens), as vLLM does; 'none' gives OpenAI's; or a folder "
        "holding a generation_config.json",
    )

    @property
    def num_processes(self) -> int:
        """HTTP server processes to start. A Python process parsing and sending events is
        CPU-bound near 42,000 streamed tokens a second (0.68x of the ZeroMQ client with a
        1B model on an H200; four made 0.94x, 56,900), and the scheduler and worker need
        their cores."""
        if self.api_server_count is not None:
            return self.api_server_count
        return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    address: str | None = _opt(
        None,
        "client address (zmq, e.g. tcp://127.0.0.1:5555; port 0: any free one, named on the "
        "ready line); default: a new ipc:// path",
    )
    allow_remote: bool = _opt(
        False,
        "let --address (ZeroMQ) or --host (HTTP) listen beyond this host (needs --api-key: "
        "CURVE on the ZeroMQ socket, which encrypts the traffic and authenticates both ends, "
        "a Bearer token over HTTP)",
    )
    api_key: str | None = _opt(
        None, "the key clients must present (default: $CBPIPE_API_KEY)", secret=True
    )
    log_level: Literal["debug", "info", "warning", "error"] = _opt("warning", "log verbosity")
    ready_timeout_s: float = _opt(600.0, "how long to wait for the processes to start")
    liveness_timeout_s: float = _opt(
        10.0,
        "a process whose heartbeat is older than this is declared stuck: the engine fails its "
        "jobs and stops",
    )

    def validate(self) -> None:
        from cbpipe.server.tools import PARSERS

        s, c = self.scheduler, self.cache
        checks = [
            (s.max_num_seqs is None or s.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
            (
                s.max_batch_tokens is None or s.max_batch_tokens >= 1,
                "--max-batch-tokens must be >= 1",
            ),
            (
                s.max_batch_tokens is None
                or s.max_num_seqs is None
                or s.max_batch_tokens >= s.max_num_seqs,
                "--max-batch-tokens must be >= --max-num-seqs (every sequence needs a row)",
            ),
            (
                self.worker.max_graph_batch is None or self.worker.max_graph_batch >= 1,
                "--max-graph-batch must be >= 1",
            ),
            (
                2 <= s.steps_in_flight <= 8,
                "--steps-in-flight must be in 2..8 (--sync runs one; each step in flight has "
                "its own slot and CUDA graphs)",
            ),
            (self.worker.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1"),
            (self.worker.mixed_graph_tokens >= 0, "--mixed-graph-tokens must be >= 0"),
            (s.debug_scheduler_delay_ms >= 0, "--debug-scheduler-delay-ms must be >= 0"),
            (s.step_timeout_s > 0, "--step-timeout-s must be > 0"),
            (s.max_waiting_requests >= 1, "--max-waiting-requests must be >= 1"),
            (self.liveness_timeout_s > 0, "--liveness-timeout-s must be > 0"),
            (c.block_size >= 1, "--block-size must be >= 1"),
            (c.num_blocks is None or c.num_blocks >= 1, "--num-blocks must be >= 1"),
            (0 < c.kv_cache_memory_fraction <= 1, "--kv-cache-memory-fraction must be in (0, 1]"),
            (
                self.model.max_model_len is None or self.model.max_model_len >= 2,
                "--max-model-len must be >= 2",
            ),
            (
                self.server.port is None or 0 <= self.server.port <= 65535,
                "--port must be in 0..65535",
            ),
            (
                self.server.api_server_count is None or self.server.api_server_count >= 1,
                "--api-server-count must be >= 1",
            ),
            (
                self.server.tool_call_parser is None or self.server.tool_call_parser in PARSERS,
                f"--tool-call-parser must be one of {', '.join(PARSERS)}",
            ),
            (
                not self.server.enable_auto_tool_choice or self.server.tool_call_parser,
                "--enable-auto-tool-choice needs --tool-call-parser",
            ),
            (
                self.server.generation_config in ("auto", "none")
                or _holds_generation_config(Path(self.server.generation_config)),
                "--generation-config must be 'auto', 'none' or a folder holding a "
                "generation_config.json (a JSON object)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_address()
        if self.server.chat_template is not None:
            # Here, not in the HTTP servers: a bad template would otherwise start the engine
            # and fail every chat request with a 400 that blames the client's messages.
            from cbpipe.server.text import check_chat_template, read_chat_template

            check_chat_template(read_chat_template(self.server.chat_template))

    def _check_address(self) -> None:
        from cbpipe.protocol.security import is_local_address

        listening = []
        if self.address is not None and not is_local_address(self.address):
            listening.append(f"--address {self.address}")
        host = self.server.host
        if self.server.port is not None and not is_local_address(
            f"tcp://[{host}]:1" if ":" in host else f"tcp://{host}:1"
        ):
            listening.append(f"--host {host}")
        if not listening:
            return
        if not self.allow_remote:
            raise ValueError(
                f"{' and '.join(listening)} listens beyond this host, where anyone who can "
                "reach it could use the engine: pass --allow-remote and --api-key to serve "
                'other machines (docs/RELIABILITY.md, "Serving other machines")'
            )
        if not self.api_key:
            raise ValueError("--allow-remote needs --api-key (or CBPIPE_API_KEY)")


def _holds_generation_config(folder: Path) -> bool:
    try:
        return isinstance(json.loads((folder / "generation_config.json").read_text()), dict)
    except (OSError, ValueError):
        return False


# --- flags from fields ----------------------------------------------------------------------


def _leaf_fields(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    hints = typing.get_type_hints(cls)
    leaves = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            leaves += _leaf_fields(hint, (*prefix, f.name))  # type: ignore[arg-type]
        else:
            leaves.append(((*prefix, f.name), (f, hint)))
    return leaves


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per leaf field of ``EngineConfig``; names are unique across groups."""
    for path, (f, hint) in _leaf_fields(EngineConfig):
        flag = "--" + path[-1].replace("_", "-")
        kwargs: dict[str, Any] = {
            "dest": "__".join(path),
            "default": f.default,
            "help": f.metadata["help"],
        }
        base = _strip_optional(hint)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(base) is Literal:
            kwargs["choices"] = get_args(base)
        else:
            kwargs["type"] = base
            kwargs["metavar"] = path[-1].upper()
        if f.default is not None and base is not bool:
            kwargs["help"] += f" (default: {f.default})"
        parser.add_argument(flag, **kwargs)


def from_arguments(args: argparse.Namespace) -> EngineConfig:
    values = vars(args)
    config = _build(EngineConfig, values, ())
    if config.api_key is None and (key := env.api_key()) is not None:
        config = dataclasses.replace(config, api_key=key)
    return config


def _build(cls: type, values: dict[str, Any], prefix: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, path)
        else:
            kwargs[f.name] = values["__".join(path)]
    return cls(**kwargs)


def _strip_optional(hint: Any) -> Any:
    if get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return hint
