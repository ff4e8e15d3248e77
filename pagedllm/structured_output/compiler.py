"""Compiling grammars off the engine loop, with a cache, and the per-request matcher."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedllm.structured_output.params import MAX_JSON_WHITESPACE, StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_SCHEMA_BYTES = 2 << 20


class GrammarCompileError(ValueError):
    """The grammar of a request could not be compiled (the message says why)."""


@dataclass(frozen=True)
class GrammarEntry:
    """A compiled grammar, its cache key, and (for the grammar worker process) its xgrammar
    JSON serialization."""

    key: tuple[str, str]
    grammar: Any  # xgrammar.CompiledGrammar
    json: str | None = None


class StructuredOutputManager:
    """Owns xgrammar's tokenizer info and compiler. ``submit`` compiles on a thread pool and
    returns a Future of the ``GrammarEntry``; equal specs share one compilation (cache keyed by
    the canonical spec). With ``serialize``, the pool also serializes each grammar for the
    grammar worker process. Tokenizer info is built once per model and kept on disk, since it
    takes seconds for a 262k vocabulary."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_key: str = "",
        max_threads: int = 2,
        serialize: bool = False,
        max_whitespace: int = MAX_JSON_WHITESPACE,
    ) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        # the engine's default JSON whitespace bound (StructuredOutputsConfig.max_whitespace)
        self.max_whitespace = max_whitespace
        self.vocab_size = vocab_size
        self.serialize = serialize
        self.tokenizer_info = self._tokenizer_info(tokenizer, vocab_size, cache_key)
        # a sampled stop token is where a grammar terminates (the bitmask allows it only there)
        self.stop_token_ids = frozenset(int(t) for t in self.tokenizer_info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.pool = ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="pagedllm-grammar"
        )
        self._cache: dict[tuple[str, str], Future] = {}
        # submit() runs on the engine thread and (through compile_now) on the server's executor
        # threads at once: the cache's check-then-insert and eviction must be atomic.
        self._lock = threading.Lock()

    def _tokenizer_info(self, tokenizer: Any, vocab_size: int, cache_key: str) -> Any:
        xgr = self.xgr
        path = None
        if cache_key:
            # keyed by the vocabulary itself, not only the model's path: a model replaced at
            # the same path (same sizes, other ids) must not get the old token table (its
            # grammars would then admit the wrong tokens)
            vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
            digest = hashlib.sha256(f"{cache_key}|{vocab_size}|{len(tokenizer)}".encode())
            digest.update(json.dumps(vocab, ensure_ascii=False).encode())
            root = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "xgrammar")
            path = os.path.join(root, digest.hexdigest()[:24] + ".json")
            if os.path.exists(path):
                try:
                    with open(path) as f:
                        return xgr.TokenizerInfo.deserialize_json(f.read())
                except Exception:  # a stale or broken cache file: rebuild it
                    logger.warning("ignoring unreadable tokenizer-info cache %s", path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = path + f".{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(info.serialize_json())
                os.replace(tmp, path)
            except OSError:
                pass
        return info

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A Future of the ``GrammarEntry`` (shared with equal earlier specs)."""
        key = params.key(self.max_whitespace)
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self.pool.submit(self._compile, key)
                self._cache[key] = fut
                if len(self._cache) > 512:  # keep the cache bounded; failures are not kept
                    self._cache.pop(next(iter(self._cache)))
        return fut

    def compile_now(self, params: StructuredOutputsParams) -> Any:
        """Compile (or fetch) synchronously; GrammarCompileError with the compiler's message."""
        fut = self.submit(params)
        try:
            return fut.result()
        except GrammarCompileError:
            key = params.key(self.max_whitespace)
            with self._lock:
                if self._cache.get(key) is fut:
                    self._cache.pop(key, None)
            raise

    def _compile(self, key: tuple[str, str]) -> GrammarEntry:
        grammar = self._compile_grammar(key)
        return GrammarEntry(key, grammar, grammar.serialize_json() if self.serialize else None)

    def _compile_grammar(self, key: tuple[str, str]) -> Any:
        kind, spec = key
        kind, _, ws_spec = kind.partition(":")  # "json:ws8": runs of at most 8 characters
        max_ws = int(ws_spec[2:]) if ws_spec.startswith("ws") else MAX_JSON_WHITESPACE
        ws: dict[str, Any] = (
            {"any_whitespace": False, "separators": (",", ":")}  # "json:ws0": compact JSON
            if max_ws == 0
            else {"max_whitespace_cnt": max_ws}
        )
        c = self.compiler
        try:
            if kind == "json":
                if len(spec) > _MAX_SCHEMA_BYTES:
                    raise GrammarCompileError(
                        f"JSON schema is {len(spec)} bytes, more than {_MAX_SCHEMA_BYTES}."
                    )
                json.loads(spec)
                return c.compile_json_schema(spec, **ws)
            if kind == "json_object":  # any JSON *object* (the builtin grammar allows arrays too)
                return c.compile_json_schema('{"type": "object"}', **ws)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "grammar":
                return c.compile_grammar(spec)
            choices = json.loads(spec)
            ebnf = "root ::= " + " | ".join(json.dumps(ch) for ch in choices)
            return c.compile_grammar(ebnf)
        except GrammarCompileError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarCompileError(f"invalid {kind}: {e}") from e

    def matcher(self, entry: GrammarEntry) -> Any:
        """A fresh matcher at the grammar's start, able to roll back speculative tokens."""
        return self.xgr.GrammarMatcher(entry.grammar)  # rollback is unlimited in xgrammar 0.2

    def allocate_bitmask(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
