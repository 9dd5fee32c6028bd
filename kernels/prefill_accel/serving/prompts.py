"""Long prompts of a chosen token length from real text, each one unique so prefix caching cannot skip the
prefill being measured.

The text is a user's file (``--corpus``) or the standard library sources (:mod:`prefill_accel.corpus`). With
the model's tokenizer the body is cut in tokens, otherwise in characters; either way the server's count
(``usage.prompt_tokens``) of a warm-up request corrects the cut before the timed requests.
"""

from __future__ import annotations

from pathlib import Path

from ..corpus import stdlib_sources
from .errors import UsageError, require

CHARS_PER_TOKEN = 3.6
"""First guess of characters per token without a tokenizer; warm-up requests replace it by the ratio the
server reports."""
CORPUS_SLACK = 1.5
"""Text loaded beyond the longest prompt's estimate, for calibration growth and distinct windows."""
QUESTION = "\n\nIn one sentence: what is the text above about?"


def header(tag: str) -> str:
    """The first line of a prompt: unique per request, so no two prompts share a cached prefix block."""
    return f"[{tag}]\n"


class PromptText:
    """Windows of a text, in tokens (``tokenizer`` given) or characters."""

    def __init__(self, text: str, tokenizer=None, source: str = ""):
        self.text = text
        self.tokenizer = tokenizer
        self.source = source
        self.ids = tokenizer(text, add_special_tokens=False).input_ids if tokenizer is not None else None
        self.chars_per_token = CHARS_PER_TOKEN

    @classmethod
    def load(cls, longest: int, corpus: Path | None = None, tokenizer: str | None = None) -> "PromptText":
        """Enough text for prompts of ``longest`` tokens, from ``corpus`` or the standard library."""
        needed = int(longest * CHARS_PER_TOKEN * CORPUS_SLACK)
        tok = None
        if tokenizer is not None:
            transformers = require("transformers", "--tokenizer")
            tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
        if corpus is not None:
            try:
                text = corpus.read_text(encoding="utf-8", errors="replace")
            except OSError as error:
                raise UsageError(f"cannot read --corpus {corpus}: {error}") from error
            source = str(corpus)
        else:
            parts, size = [], 0
            for part in stdlib_sources():
                parts.append(part)
                size += len(part) + 2
                if size >= needed:
                    break
            text, source = "\n\n".join(parts), "Python standard library sources"
        prompt_text = cls(text, tok, source)
        if prompt_text.units < prompt_text.initial_units(longest) * 1.2:
            raise UsageError(f"the corpus ({source}) holds {prompt_text.units} {prompt_text.unit_name}, too few for "
                             f"distinct {longest}-token prompts; give a longer --corpus")  # fmt: skip
        return prompt_text

    @property
    def unit_name(self) -> str:
        return "tokens" if self.ids is not None else "characters"

    @property
    def units(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.text)

    def initial_units(self, length: int) -> int:
        """The body size first tried for a prompt of ``length`` tokens."""
        return length if self.ids is not None else round(length * self.chars_per_token)

    def calibrate(self, units: int, length: int, prompt_tokens: int) -> int:
        """The body size that should give ``length`` tokens, after ``units`` gave ``prompt_tokens``."""
        if self.ids is not None:
            return max(1, units + length - prompt_tokens)
        self.chars_per_token = units / prompt_tokens
        return max(1, round(units * length / prompt_tokens))

    def body(self, units: int, index: int) -> str:
        """``units`` of text starting at a place that depends on ``index``."""
        units = min(units, self.units)
        start = (index * 7919 * 13) % max(self.units - units, 1)
        if self.ids is not None:
            return self.tokenizer.decode(self.ids[start : start + units])
        return self.text[start : start + units]

    def prompt(self, units: int, index: int, tag: str) -> str:
        return header(tag) + self.body(units, index) + QUESTION
