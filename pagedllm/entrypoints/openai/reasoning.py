"""Reasoning output (``--reasoning-parser``): the text a model thinks in before it answers,
split from the answer into ``reasoning_content`` (vLLM's field), in whole replies and in
streamed deltas.

Both parsers here read the ``<think> ... </think>`` format:

- ``qwen3``: Qwen3 writes ``<think>`` itself when it thinks; an output that does not open with
  it (``enable_thinking=False``, or a non-thinking model) is all answer.
- ``deepseek_r1``: DeepSeek-R1's template opens the thinking in the prompt, so the output starts
  inside it (a ``<think>`` the model writes anyway is dropped); everything up to ``</think>`` is
  reasoning, and an output cut before ``</think>`` is all reasoning.

Where the rendered prompt settles it, the prompt wins: a prompt that ends with ``<think>``
starts the output in the thinking (Qwen3's 2507 thinking template, R1), one that ends with
``</think>`` (Qwen3 with ``enable_thinking=False``) starts it in the answer.

Example (qwen3): ``"<think>\\nAdd them.\\n</think>\\n\\n4"`` -> reasoning ``"\\nAdd them.\\n"``,
answer ``"\\n\\n4"``; the server strips neither (vLLM does not either).

Structured outputs (and tool calls under ``required`` or a named function) apply to the answer
only: the request carries the ``</think>`` token's id and the engine's grammar starts after it
(``StructuredOutputsParams.reasoning_end_token_id``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import split_held

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family marks its thinking."""

    name: str
    start: str = START
    end: str = END
    # the output starts inside the thinking unless the prompt says otherwise
    starts_in_reasoning: bool = False


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format of ``--reasoning-parser name``; ValueError naming the choices."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser: unknown parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}."
        ) from None


def reasoning_token_ids(fmt: ReasoningFormat, tokenizer: Any) -> tuple[int, int]:
    """(start, end) tags as single tokens of ``tokenizer``; ValueError if the tokenizer spells
    one in several tokens (the engine gates grammars on token ids)."""
    out = []
    for tag in (fmt.start, fmt.end):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"--reasoning-parser {fmt.name}: this model's tokenizer has no single token "
                f"for {tag!r} (it encodes to {len(ids)} tokens), so it is not a {fmt.name} "
                "model."
            )
        out.append(int(ids[0]))
    return out[0], out[1]


class ReasoningSplitter:
    """Splits one choice's output, delta by delta, into (reasoning, answer) pieces.

    States: ``opening`` (qwen3, not yet known whether the output opens with ``<think>``),
    ``thinking``, ``answer``. Text that could be the start of a tag is held back until the next
    delta or ``finish``; the tags themselves are never emitted."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str | None = None) -> None:
        self.fmt = fmt
        tail = (prompt_text or "").rstrip()
        if tail.endswith(fmt.end):
            self.state = "answer"
        elif tail.endswith(fmt.start) or fmt.starts_in_reasoning:
            self.state = "thinking"
        else:
            self.state = "opening"
        self._skip_start = self.state == "thinking"  # drop a <think> the model writes anyway
        self.thought = self.state == "thinking"  # the output had a thinking part
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer) text that ``delta`` completes."""
        self._buf += delta
        reasoning, answer = "", ""
        while self._buf:
            if self.state == "opening":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.fmt.start):
                    self._buf = stripped[len(self.fmt.start) :]
                    self.state = "thinking"
                    self.thought = True
                    continue
                if self.fmt.start.startswith(stripped):
                    return reasoning, answer  # maybe the opening tag: wait
                self.state = "answer"
                continue
            if self.state == "thinking":
                if self._skip_start:
                    stripped = self._buf.lstrip()
                    if self.fmt.start.startswith(stripped):
                        return reasoning, answer
                    self._skip_start = False
                    if stripped.startswith(self.fmt.start):
                        self._buf = stripped[len(self.fmt.start) :]
                        continue
                i = self._buf.find(self.fmt.end)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf = self._buf[i + len(self.fmt.end) :]
                    self.state = "answer"
                    continue
                settled, self._buf = split_held(self._buf, self.fmt.end)
                return reasoning + settled, answer
            answer += self._buf
            self._buf = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output: an unfinished tag is plain text of
        the part it was in (an unclosed opening check is answer)."""
        rest, self._buf = self._buf, ""
        if self.state == "thinking":
            return rest, ""
        return "", rest


def split_reasoning(fmt: ReasoningFormat, text: str, prompt_text: str | None = None
                    ) -> tuple[str | None, str]:  # fmt: skip
    """A whole output as (reasoning, or None when it had no thinking part; answer)."""
    s = ReasoningSplitter(fmt, prompt_text)
    r1, a1 = s.feed(text)
    r2, a2 = s.finish()
    return (r1 + r2 if s.thought else None), a1 + a2
