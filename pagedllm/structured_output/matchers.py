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
A key names one request's matcher (the scheduler's ``Request.grammar_key``). A request that
verifies draft tokens (speculative decoding) is filled as ``SpecFill(key, drafts)``: one
bitmask row per position, each after the drafts before it (see ``MatcherSet.fill``); one whose
first token may open its thinking as ``OpenFill(key, token)``: the grammar's row plus that
token.
In the worker process, ``grammar`` in "add" is the cache key of a grammar sent before by
("grammar", spec_key, serialized_json), and ("forget", spec_key) frees one; ``GrammarWorkerState``
resolves them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np


class SpecFill(NamedTuple):
    """A fill entry for a request verifying ``drafts``: 1 + len(drafts) bitmask rows."""

    key: Hashable
    drafts: tuple[int, ...]


class OpenFill(NamedTuple):
    """A fill entry for a request whose first token may open its thinking (Qwen3's
    ``<think>``): its grammar's first mask row, plus ``token``."""

    key: Hashable
    token: int


def fill_rows(entries: Sequence[Any]) -> int:
    """Bitmask rows the fill entries take: one per key, 1 + k per ``SpecFill`` with k drafts."""
    return sum(1 + len(e.drafts) if isinstance(e, SpecFill) else 1 for e in entries)


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

    def fill(self, keys: list[Any], out: np.ndarray) -> None:
        """Bitmask rows, in order, for ``keys`` (``[>= fill_rows(keys), ceil(vocab / 32)]``
        int32): a key gets one row, its next token's mask; ``SpecFill(key, drafts)`` gets
        1 + k rows, row j the mask after drafts 0..j-1 (accepted for the fill, then rolled
        back). A request with no live matcher (ended, or its grammar already terminated) gets
        all ones, as do a draft's rows after a draft the grammar refuses: those samples are
        dropped (the refused draft can't equal a sample its own row masked out), so any is
        fine."""
        live: list[Any] = []
        rows: list[int] = []
        row = 0
        for entry in keys:
            if isinstance(entry, SpecFill):
                self._fill_spec(entry, out, row)
                row += 1 + len(entry.drafts)
                continue
            if isinstance(entry, OpenFill):  # the grammar's row, and the thinking's opener
                m = self.matchers.get(entry.key)
                if m is None or m.is_terminated():
                    out[row] = -1
                else:
                    m.fill_next_token_bitmask(out, row)
                    word, bit = divmod(entry.token, 32)
                    out[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # (int32 words)
                row += 1
                continue
            m = self.matchers.get(entry)
            if m is None or m.is_terminated():
                out[row] = -1
            else:
                live.append(m)
                rows.append(row)
            row += 1
        if len(live) == 1:
            live[0].fill_next_token_bitmask(out, rows[0])
        elif live:  # xgrammar fills the rows on its own thread pool
            if self._batch is None:
                self._batch = self._xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
            self._batch.batch_fill_next_token_bitmask(live, out, indices=rows)

    def _fill_spec(self, entry: SpecFill, out: np.ndarray, row: int) -> None:
        """Rows ``row .. row + k`` of a request verifying k drafts. Example: drafts [a, b],
        the grammar refuses b -> row 0: mask now; row 1: mask after a; row 2: all ones."""
        n = 1 + len(entry.drafts)
        m = self.matchers.get(entry.key)
        if m is None or m.is_terminated():
            out[row : row + n] = -1
            return
        m.fill_next_token_bitmask(out, row)
        accepted = 0
        for j, token in enumerate(entry.drafts):
            if m.is_terminated() or not m.accept_token(token):
                out[row + 1 + j : row + n] = -1
                break
            accepted += 1
            if m.is_terminated():
                out[row + 1 + j : row + n] = -1
                break
            m.fill_next_token_bitmask(out, row + 1 + j)
        if accepted:
            m.rollback(accepted)
