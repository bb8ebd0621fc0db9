"""The server's side of text: prompts and chat templates to token ids, token ids to the
strings that log-probabilities are reported under.

The server tokenizes (the scheduler's step loop never sees an HTTP prompt as text); the
scheduler detokenizes, because stop strings are matched in its text. A model without a
tokenizer (the random-weight presets) takes token-id prompts only, answers with empty
texts, and names tokens ``token_id:<id>`` where a string is due (vLLM's spelling).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any


class TextError(ValueError):
    """A prompt or conversation this model cannot take; the message says why."""


class Text:
    """Tokenization for one model, or its absence (``tokenizer`` None)."""

    def __init__(self, tokenizer: Any | None, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.token_string = lru_cache(maxsize=1 << 16)(self._token_string)

    @classmethod
    def load(cls, path: Path | None, model_name: str, chat_template: str | None) -> Text:
        """The tokenizer of the checkpoint folder ``path`` (None: no tokenizer), with
        ``chat_template`` (a file or the template itself) instead of its own."""
        if path is None:
            return cls(None, model_name)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            tokenizer.chat_template = read_chat_template(chat_template)
        return cls(tokenizer, model_name)

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def encode(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """A text prompt's token ids, by default as the engine's own text path has them (no
        special tokens added: a prompt that wants a BOS says so)."""
        if self.tokenizer is None:
            raise TextError(
                f"model {self.model_name} has no tokenizer: send the prompt as token ids"
            )
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def vocabulary_names(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (``Ġworld`` for a byte-level BPE's
        " world"), as vLLM's ``/tokenize`` gives them."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        return [str(name) for name in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens skipped, as in the engine's outputs);
        "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids of a conversation rendered by the model's chat template, with the
        ``tools`` it may call (OpenAI's function definitions) where given."""
        if self.tokenizer is None:
            raise TextError(f"model {self.model_name} has no tokenizer: chat needs one")
        if not getattr(self.tokenizer, "chat_template", None):
            raise TextError(
                f"model {self.model_name} has no chat template: start the server with "
                "--chat-template, or use /v1/completions"
            )
        if add_generation_prompt and continue_final_message:
            raise TextError("add_generation_prompt and continue_final_message exclude each other")
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
        except Exception as exc:  # jinja2 and the template's own raise_exception
            raise TextError(f"the chat template refused the messages: {exc}") from None
        # The template writes the special tokens (a BOS, say) it wants; add none.
        return list(self.tokenizer(rendered, add_special_tokens=False).input_ids)

    def _token_string(self, token_id: int) -> str:
        """How one token is named in log-probabilities: its text alone, as vLLM reports it
        (a piece of a multi-byte character reads as U+FFFD)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))


# A chat template has at least one of these; a file's name, vLLM reasons, has none.
TEMPLATE_CHARS = "{}\n"


def read_chat_template(value: str) -> str:
    """The chat template that ``--chat-template value`` gives, read as vLLM reads it: the
    text of the file ``value`` names, else ``value`` itself if it could be a template (it
    holds a ``{``, ``}`` or newline). Raises ``ValueError`` naming the file otherwise."""
    try:
        return Path(value).read_text()
    except OSError as exc:  # no such file, a folder, a name too long (a template's own text)
        if any(char in value for char in TEMPLATE_CHARS):
            return value
        raise ValueError(
            f"--chat-template {value}: cannot read {Path(value).absolute()} "
            f"({exc.strerror or exc}), and the value is no template itself (it has no "
            "'{', '}' or newline)"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--chat-template {value}: not UTF-8 text ({exc.reason})") from None


def check_chat_template(template: str) -> None:
    """Raises ``ValueError`` unless ``template`` compiles as transformers compiles it for
    ``apply_chat_template`` (a sandboxed Jinja environment with its extensions)."""
    from jinja2 import TemplateError

    compile: Callable[[str], object]
    try:  # transformers' own, private: a release without it gets plain sandboxed Jinja
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string
    try:
        compile(template)
    except TemplateError as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ValueError(f"--chat-template does not compile: {exc.message}{where}") from None
