"""The grammar matchers of live structured requests: advanced by an ordered list of operations,
and turned into one token bitmask per step. The same code runs in the engine's process
(``LocalGrammars``) and in the grammar worker process (``grammar_worker.py``); it needs only
xgrammar and numpy.

Operations, applied in the order the scheduler issued them (tuples, so they pickle cheaply):
    ("add", key, grammar)               a matcher at the grammar's start
    ("fork", parent_key, child_key)     the child continues from the parent's state (n > 1)
    ("accept", key, token_id)           advance by one sampled token
    ("accepts", keys, token_ids)        the same for each pair, in order
    ("rollback", key, n)                undo the last n accepted tokens (speculative decoding)
    ("drop", key)                       the request ended
A key names one request's matcher (the scheduler's ``Request.grammar_key``).
In the worker process, ``grammar`` in "add" is the cache key of a grammar sent before by
("grammar", spec_key, serialized_json), and ("forget", spec_key) frees one; ``GrammarWorkerState``
resolves them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np


class MatcherSet:
    """xgrammar matchers by key. ``apply`` runs operations; ``fill`` writes the
    bitmask rows of the requests that sample next. A token the grammar rejects is reported,
    not raised: the engine ends that request alone."""

    def __init__(self, fill_threads: int | str = "auto") -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.matchers: dict[Hashable, Any] = {}
        self._fill_threads = fill_threads
        self._batch = None  # xgrammar's batch filler, made on first use

    def apply(self, ops: list[tuple], resolve: Any = None) -> dict[Hashable, str]:
        """Run ``ops`` in order; returns {key: why its token was rejected}.
        ``resolve`` maps the grammar field of "add" to a compiled grammar (identity if None);
        other operation kinds go to ``resolve.other(op)`` when given."""
        rejected: dict[Hashable, str] = {}
        matchers = self.matchers
        for op in ops:
            kind = op[0]
            if kind == "accepts":
                for rid, tok in zip(op[1], op[2]):
                    self._accept(rid, tok, rejected)
            elif kind == "accept":
                self._accept(op[1], op[2], rejected)
            elif kind == "add":
                grammar = op[2] if resolve is None else resolve.grammar(op[2])
                matchers[op[1]] = self._xgr.GrammarMatcher(grammar)  # rollback is unlimited
            elif kind == "fork":
                m = matchers.get(op[1])
                if m is not None:
                    matchers[op[2]] = m.fork()
            elif kind == "rollback":
                m = matchers.get(op[1])
                if m is not None and op[2] > 0:
                    m.rollback(op[2])
            elif kind == "drop":
                matchers.pop(op[1], None)
            elif resolve is not None:
                resolve.other(op)
            else:
                raise ValueError(f"unknown grammar operation {kind!r}")
        return rejected

    def _accept(self, rid: Hashable, token: int, rejected: dict[Hashable, str]) -> None:
        m = self.matchers.get(rid)
        if m is None or m.is_terminated():
            return  # ended already: dropped, or its request's finish is on the way
        if not m.accept_token(token):
            rejected[rid] = f"token {token} rejected by the grammar"

    def fill(self, keys: list[Hashable], out: np.ndarray) -> None:
        """Row i of ``out`` ([>= len(keys), ceil(vocab / 32)] int32) gets the bitmask of
        keys[i]'s next token; a request with no live matcher (ended, or its grammar
        already terminated) gets all ones: its token is dropped, so any is fine."""
        live: list[Any] = []
        rows: list[int] = []
        for i, key in enumerate(keys):
            m = self.matchers.get(key)
            if m is None or m.is_terminated():
                out[i] = -1
            else:
                live.append(m)
                rows.append(i)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(out, rows[0])
        elif live:  # xgrammar fills the rows on its own thread pool
            if self._batch is None:
                self._batch = self._xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
            self._batch.batch_fill_next_token_bitmask(live, out, indices=rows)
