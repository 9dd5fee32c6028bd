"""RULER-style needle-in-a-haystack prompts: a noise haystack, one key-value needle, a question.

The haystack repeats filler sentences; the needle "One of the special magic numbers for <key> is:
<7-digit value>." sits at a chosen depth; the question at the end asks for the key's number.
Prompts are built to a token budget with the model's own tokenizer and chat template.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEYS = (
    "apple", "river", "candle", "falcon", "marble", "orchid", "lantern", "harbor", "violin", "glacier",
    "pepper", "meadow", "comet", "saddle", "thunder", "walnut", "compass", "ember", "quartz", "willow",
)  # fmt: skip
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"


@dataclass(frozen=True)
class NeedlePrompt:
    """One prompt: its token ids, the needle's key and value, and where the needle landed."""

    input_ids: list[int]
    key: str
    value: str
    depth: float
    """Requested depth, a share of the haystack in [0, 1]."""
    needle_token_pos: int
    """Token position where the needle sentence starts."""


def needle_sentence(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}. "


def question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text?"


def parse_answer(text: str) -> str | None:
    """The first 7-digit number in the generated text (digits may be split by spaces), or None."""
    match = re.search(r"(?<!\d)(\d(?:\s?\d){6})(?!\d)", text)
    return match.group(1).replace(" ", "") if match else None


def _render(tokenizer, haystack: str, key: str) -> str:
    user = INSTRUCTION + haystack + "\n" + question(key)
    answer = ANSWER_PREFIX.format(key=key)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt + answer
    return user + "\n" + answer


def _encode(tokenizer, text: str) -> list[int]:
    # Chat templates already spell out BOS; a plain prompt gets the tokenizer's special tokens.
    has_template = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer(text, add_special_tokens=not has_template).input_ids


def build_prompt(tokenizer, length: int, depth: float, key: str, value: str) -> NeedlePrompt:
    """A prompt of at most ``length`` tokens (and within a few filler sentences of it), needle at ``depth``.

    Filler sentences are counted, not characters, so the needle always starts a sentence.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must lie in [0, 1], got {depth}")
    sentences = [s + "." for s in FILLER.split(".") if s.strip()]
    sentences = [" " + s.strip() for s in sentences]
    per_cycle = len(_encode(tokenizer, "".join(sentences) * 8)) / (8 * len(sentences))
    overhead = len(_encode(tokenizer, _render(tokenizer, needle_sentence(key, value), key)))
    count = max(int((length - overhead) / per_cycle), 0)

    def assemble(n: int) -> tuple[str, str]:
        filler = [sentences[i % len(sentences)] for i in range(n)]
        cut = round(depth * n)
        before = "".join(filler[:cut]).strip()
        return before, (before + " " if before else "") + needle_sentence(key, value) + "".join(filler[cut:]).strip()

    best = None
    for _ in range(32):  # the count estimate converges in a few steps; the cap only guards oscillation
        before, haystack = assemble(count)
        ids = _encode(tokenizer, _render(tokenizer, haystack, key))
        if len(ids) <= length and (best is None or len(ids) > len(best[2])):
            best = (before, haystack, ids)
        slack = length - len(ids)
        if 0 <= slack < 2 * per_cycle or (slack < 0 and count == 0):
            break
        count = max(count + (int(slack / per_cycle) - 1 if slack > 0 else -max(1, int(-slack / per_cycle) + 1)), 0)
    if best is None:
        raise ValueError(f"a needle prompt needs {len(ids)} tokens, more than the requested length {length}")
    before, _, ids = best
    # No trailing space: BPE tokenizers fold it into the needle's first word.
    prefix = _render(tokenizer, before + "\x00", key).split("\x00")[0]
    return NeedlePrompt(ids, key, value, depth, len(_encode(tokenizer, prefix)))


def build_prompts(tokenizer, length: int, depths: list[float], seed: int = 0) -> list[NeedlePrompt]:
    """One prompt per depth, each with its own key and random 7-digit value (reproducible by ``seed``)."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, len(depths)) if len(depths) <= len(KEYS) else [rng.choice(KEYS) for _ in depths]
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in depths]
    return [build_prompt(tokenizer, length, d, key, value) for d, key, value in zip(depths, keys, values)]
