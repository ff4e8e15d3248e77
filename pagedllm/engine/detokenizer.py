"""Incremental detokenization with stop-string handling.

Each request owns one :class:`IncrementalDetokenizer`. Every engine step passes the newly
sampled token ids to :meth:`IncrementalDetokenizer.update`, which appends their text to
:attr:`IncrementalDetokenizer.output_text` and reports a matched stop string, if any. The text
to stream to the client comes from :meth:`IncrementalDetokenizer.get_next_output_text`.

Decoding uses the prefix/read offset scheme of vLLM's ``detokenize_incrementally`` (and HF's
``TextStreamer``): a short window of already-read tokens is decoded together with the new
tokens, and the new text is the difference. This keeps per-token cost independent of the
sequence length while decoding every token in context (sentencepiece tokenizers drop the
leading space of a lone token; byte-level BPE splits multi-byte characters across tokens).

With a stock fast tokenizer, the Rust ``tokenizers.decoders.DecodeStream`` runs the same scheme
in one call per token (two decodes per token otherwise); the window is still
kept here, so a run of ``MAX_PENDING_TOKENS`` tokens without valid text, and the final flush,
go through the exact path above.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
#: How many trailing prompt tokens are decoded as context for the first output tokens.
INITIAL_CONTEXT_TOKENS = 5
#: Tokens that may be held back waiting for a multi-byte character to complete. A valid
#: UTF-8 character has at most 4 bytes and each token carries at least one, so text that still
#: ends in U+FFFD after this many pending tokens comes from a truly invalid byte sequence.
MAX_PENDING_TOKENS = 6


class DecodingTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> str:
        """Decode token ids into a string."""
        ...


def _rust_decoder(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer, when the
    tokenizer's own ``_decode`` is the stock one: with ``clean_up_tokenization_spaces=False``
    the wrapper adds nothing but Python argument conversion per call, which at hundreds of
    running requests is a large share of a decode step's host time. None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - older transformers
        return None
    if not isinstance(backend, Tokenizer) or not isinstance(tokenizer, TokenizersBackend):
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None  # a subclass post-processes decoded text: keep its decode()
    return backend.decode


def _decode_stream(context: list[int], context_text: str, skip_special_tokens: bool) -> Any:
    """A ``DecodeStream`` primed with ``context`` (which decodes to ``context_text``), or None
    when this ``tokenizers`` lacks it or the context does not decode to whole characters: the
    stream would then emit the context's text with the first token, where this module treats
    the context as already read."""
    if REPLACEMENT_CHAR in context_text:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # pragma: no cover - tokenizers < 0.22
        return None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, one step at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with a compatible ``decode``).
        prompt_token_ids: the prompt; its last few tokens give the decoding context.
        skip_special_tokens: drop special tokens (e.g. ``<|im_end|>``) from the text.
        spaces_between_special_tokens: forwarded to ``tokenizer.decode`` (only slow
            tokenizers honour it).
        stop: stop strings; the first one to appear ends the request.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        use_decode_stream: decode through the Rust ``DecodeStream`` where possible (the same
            text; False forces the Python-level path, for tests and comparisons).
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        use_decode_stream: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        #: Characters held back from streaming so a partial stop string is never shown.
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self.output_token_ids: list[int] = []
        #: The stop string that matched, once one has.
        self.stop_reason: str | None = None
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        self._fast = _rust_decoder(tokenizer)
        self._text = ""
        self._sent = 0  # characters already returned by get_next_output_text(delta=True)
        # Decoding window: _window[:_read] was already turned into text (decoding to
        # _prefix_text; None = not computed yet, on the DecodeStream path); _window[_read:]
        # are pending tokens whose text is not emitted yet.
        self._window: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text: str | None = self._decode(self._window)
        # the Rust DecodeStream, for stock fast tokenizers only (those _fast decodes)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = (
            _decode_stream(self._window, self._prefix_text, skip_special_tokens)
            if use_decode_stream and self._fast is not None
            else None
        )

    @property
    def output_text(self) -> str:
        """The full output text so far (never ends inside a broken UTF-8 character)."""
        return self._text

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose text is held back (e.g. part of an incomplete multi-byte character)."""
        return len(self._window) - self._read

    def update(self, new_token_ids: list[int], *, stop_terminated: bool = False) -> str | None:
        """Append new tokens (1 or more per step); return the stop string matched, if any.

        When a stop string matches, ``output_text`` is truncated at the stop string (kept if
        ``include_stop_str_in_output``) and the caller finishes the request with
        ``stop_reason`` = that string. Tokens passed after a match are recorded but ignored.

        Pass ``stop_terminated=True`` when the last token is the EOS token or one of the
        request's stop token ids: like vLLM, its text is then left out (e.g. ``<|im_end|>``
        with ``skip_special_tokens=False``) unless ``include_stop_str_in_output``.
        """
        self.output_token_ids.extend(new_token_ids)
        if self.stop_reason is not None:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        check_from = len(self._text)
        pieces = [self._decode_next(token_id) for token_id in new_token_ids]
        self._text += "".join(pieces)
        return self._check_stop(check_from)

    def flush(self) -> str | None:
        """Emit the text of pending tokens even if it ends in an incomplete character.

        Called automatically by ``get_next_output_text(finished=True, ...)``; the text then
        ends in U+FFFD, like ``tokenizer.decode`` of the same tokens. Does nothing after a stop
        string matched. Returns a stop string if the flushed text completed one.
        """
        if self.stop_reason is not None or self.num_pending_tokens == 0:
            return None
        check_from = len(self._text)
        self._stream = None  # the window moves on without it: the exact path from here
        self._text += self._decode(self._window)[len(self._prefix()) :]
        self._advance()
        return self._check_stop(check_from)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: the new part since the last call if delta, else all.

        While not finished and stop strings exist, the last (max stop len - 1) characters are
        held back so that a streamed text never shows part of a stop string; when finished (or
        once a stop string matched), everything is released, pending tokens included.
        """
        if finished:
            self.flush()
        end = len(self._text)
        if not finished and self.stop_reason is None:
            end = max(end - self.stop_buffer_length, 0)
        if not delta:
            return self._text[:end]
        if end <= self._sent:
            return ""
        text = self._text[self._sent : end]
        self._sent = end
        return text

    def _decode(self, token_ids: list[int]) -> str:
        """Decode ``token_ids`` with this request's options."""
        if not token_ids:
            return ""
        if self._fast is not None:
            return self._fast(token_ids, skip_special_tokens=self.skip_special_tokens)
        try:
            return self.tokenizer.decode(token_ids, **self._decode_kwargs)
        except TypeError:
            if len(self._decode_kwargs) == 1:
                raise
            # A tokenizer whose decode() takes fewer options.
            self._decode_kwargs = {"skip_special_tokens": self.skip_special_tokens}
            return self.tokenizer.decode(token_ids, **self._decode_kwargs)

    def _prefix(self) -> str:
        """The text of the window's read tokens (computed when the DecodeStream skipped it)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._prefix_text

    def _decode_next(self, token_id: int) -> str:
        """Add one token to the window and return the text that can be emitted now."""
        self._window.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # the stream gives up on some byte-fallback sequences
                piece, self._stream = None, None
            if piece is not None:  # the stream emitted from the same window: advance ours
                del self._window[: self._read]
                self._read = len(self._window)
                self._prefix_text = None
                return piece
            elif self._stream is not None:
                if len(self._window) - self._read < MAX_PENDING_TOKENS:
                    return ""
                self._stream = None  # a long run without valid text: the exact path from here
        text = self._decode(self._window)
        pending = len(self._window) - self._read
        if text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS:
            return ""  # wait for the rest of a multi-byte character
        new_text = text[len(self._prefix()) :]
        if not new_text:
            # The pending tokens decode to nothing (e.g. skipped special tokens). Drop them so
            # the window stays small; keep them while they follow no text, since then they may
            # be a space that a sentencepiece decoder strips at the start of the window.
            if self._prefix() or pending >= MAX_PENDING_TOKENS:
                del self._window[self._read :]
            return ""
        self._advance()
        return new_text

    def _advance(self) -> None:
        """Make the just-emitted tokens the new decoding prefix."""
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)

    def _check_stop(self, check_from: int) -> str | None:
        """Look for a stop string ending after ``check_from``; truncate the text on a match."""
        if not self.stop or len(self._text) <= check_from:
            return None
        best: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = self._text.find(stop_str, max(check_from - len(stop_str) + 1, 0))
            if start != -1 and (best is None or (start, len(stop_str)) < best[:2]):
                best = (start, len(stop_str), stop_str)
        if best is None:
            return None
        start, length, stop_str = best
        self._text = self._text[: start + length if self.include_stop_str_in_output else start]
        self._sent = min(self._sent, len(self._text))
        self.stop_reason = stop_str
        return stop_str
