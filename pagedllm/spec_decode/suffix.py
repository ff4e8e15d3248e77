"""Suffix decoding ("suffix" in vLLM; SuffixDecoding, arXiv 2411.04975, as in Arctic Inference):
draft the continuation that most often followed the current suffix of the text.

Two kinds of tree, both depth-limited suffix tries with a count per node (how many occurrences
of that token string, of at most ``max_depth`` tokens, the tree's sequences hold):

- one per running request, over its prompt and output so far, grown as tokens arrive;
- one global tree over the outputs of the last ``max_cached_requests`` finished requests (the
  oldest leaves first, as vLLM's FIFO eviction).

To propose, each tree finds the longest suffix of the request's tokens that occurs in it with a
continuation (at most ``max_depth - 1`` tokens), picks the match length m that allows the
longest draft, ``min(k, floor(max_spec_factor * m), max_depth - m)`` (the tree's depth bounds the
match plus the draft), and walks down from there to the most frequent child (ties: the one seen
most recently) while the product of child count / parent count stays >= ``min_token_prob``. The
better of the two drafts (longer, then more probable; the request's own on a tie) is proposed.

Storage: a node whose string occurred once is a leaf that points at that occurrence (sequence,
start) instead of storing the rest of its path, so only strings seen at least twice cost more
than one node -- as in Arctic Inference, which also compresses paths. Nodes live in flat arrays
indexed by node id, with one dict from (parent, token) to child.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections import deque
from collections.abc import Sequence

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import check_k

_SHIFT = 32  # edge key = parent << 32 | token; node ref = sequence number << 32 | start
_MASK = (1 << _SHIFT) - 1
_ROOT = 0

Location = tuple[int, int]  # (node, extra): ``extra`` tokens below a once-seen node, on its path


class _SuffixTrie:
    """A depth-limited suffix trie with counts over token sequences, in flat arrays.

    Logically it holds every string of at most ``max_depth`` tokens that occurs in its sequences,
    with ``count`` = its number of occurrences (start positions). Stored are the root, every
    string that occurs at least twice, and each child of those: a child that occurred once is a
    leaf whose ``ref`` names its one occurrence, and the strings below it are read off that
    sequence. A stored node's ``ref`` is its most recent occurrence, ``(sequence << 32) |
    start``, and ``best`` its child with the largest (count, ref): the most frequent, the most
    recently seen on a tie. The root keeps neither.

    Memory: one dict entry (~100 bytes) and 5 int64 array slots per stored node (8 in the
    global trie). Each token added creates at most 1 + r nodes, r = the length of the longest
    string ending there that occurred before (at most ``max_depth - 1``): so n tokens store at
    most n * max_depth nodes, and text whose repeats are short a few per token.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth!r}.")
        self.max_depth = max_depth
        self.seqs: dict[int, list[int]] = {}
        self._edges: dict[int, int] = {}  # parent << 32 | token -> child
        self._count = array("q", [0])
        self._token = array("q", [-1])
        self._depth = array("q", [0])
        self._ref = array("q", [-1])
        self._best = array("q", [-1])

    @property
    def num_nodes(self) -> int:
        """Stored nodes, the root excluded."""
        return len(self._count) - 1

    def advance(self, loc: Location, token: int) -> Location | None:
        """The location of ``loc``'s string followed by ``token``, or None if that string does
        not occur (or would be longer than ``max_depth``)."""
        node, extra = loc
        if extra == 0 and (node == _ROOT or self._count[node] >= 2):
            child = self._edges.get((node << _SHIFT) | token)
            return None if child is None else (child, 0)
        depth = self._depth[node] + extra
        ref = self._ref[node]
        seq = self.seqs[ref >> _SHIFT]
        pos = (ref & _MASK) + depth
        if depth < self.max_depth and pos < len(seq) and seq[pos] == token:
            return (node, extra + 1)
        return None

    def has_continuation(self, loc: Location) -> bool:
        """Whether ``loc``'s string (not the root's) was ever followed by a token here."""
        node, extra = loc
        if extra == 0 and self._count[node] >= 2:
            return self._best[node] >= 0
        depth = self._depth[node] + extra
        ref = self._ref[node]
        return depth < self.max_depth and (ref & _MASK) + depth < len(self.seqs[ref >> _SHIFT])

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of the string ``tokens`` (1 to ``max_depth`` tokens) in the trie."""
        loc: Location | None = (_ROOT, 0)
        for token in tokens:
            loc = self.advance(loc, token)
            if loc is None:
                return 0
        node, extra = loc
        return 1 if extra else self._count[node]

    def draft(self, loc: Location, budget: int, min_prob: float) -> tuple[list[int], float]:
        """Up to ``budget`` tokens below ``loc``: the best child each time, while the product
        of child count / parent count stays >= ``min_prob``; and that product."""
        node, extra = loc
        out: list[int] = []
        prob = 1.0
        count, best, token = self._count, self._best, self._token
        while len(out) < budget:
            n = count[node]
            if extra == 0 and n >= 2:
                child = best[node]
                if child < 0:
                    break
                p = prob * count[child] / n
                if p < min_prob:
                    break
                prob = p
                out.append(token[child])
                node = child
                continue
            # seen once: the rest is that one occurrence's continuation (probability 1 each)
            depth = self._depth[node] + extra
            ref = self._ref[node]
            seq = self.seqs[ref >> _SHIFT]
            pos = (ref & _MASK) + depth
            take = min(budget - len(out), self.max_depth - depth, len(seq) - pos)
            if take > 0:
                out.extend(seq[pos : pos + take])
            break
        return out, prob


class _RequestTrie(_SuffixTrie):
    """The suffix trie of one request's tokens (sequence 0), grown token by token.

    ``active[d]`` is the node of the last d tokens for d = 0 (root), 1, 2, ... as long as that
    string occurred at least twice and is shorter than ``max_depth``: the suffixes that match an
    earlier occurrence with a continuation (that occurrence ends before the last token, so a
    token followed it). Appending a token steps each of them into its child; every longer
    suffix occurred once, lies on the path of its own leaf, and costs nothing. One token costs
    O(1 + len(active)) dict operations.
    """

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.tokens: list[int] = []
        self.seqs[0] = self.tokens
        self.active: list[int] = [_ROOT]

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` (ints in [0, 2**32)) to the sequence (the proposer's hot loop,
        so the node updates are written out here)."""
        seq, edges, max_depth = self.tokens, self._edges, self.max_depth
        count, token_of, depth_of = self._count, self._token, self._depth
        ref_of, best_of = self._ref, self._best
        for token in tokens:
            pos = len(seq)
            seq.append(token)
            active = [_ROOT]
            for d, node in enumerate(self.active):
                # the suffix of d + 1 tokens ending at pos: node's string + token
                key = (node << _SHIFT) | token
                child = edges.get(key)
                if child is None:  # its first occurrence: a leaf pointing at it
                    child = len(count)
                    edges[key] = child
                    count.append(1)
                    token_of.append(token)
                    depth_of.append(d + 1)
                    ref_of.append(pos - d)
                    best_of.append(-1)
                    n = 1
                else:
                    n = count[child]
                    if n == 1 and d + 1 < max_depth:
                        # seen once until now: store the next node of that occurrence, which
                        # ended before pos (so a token followed it)
                        other = ref_of[child]
                        nxt = seq[other + d + 1]
                        grand = len(count)
                        edges[(child << _SHIFT) | nxt] = grand
                        count.append(1)
                        token_of.append(nxt)
                        depth_of.append(d + 2)
                        ref_of.append(other)
                        best_of.append(-1)
                        best_of[child] = grand
                    n += 1
                    count[child] = n
                    ref_of[child] = pos - d
                if node != _ROOT:
                    best = best_of[node]
                    if best < 0 or n >= count[best]:  # the newest wins a tie
                        best_of[node] = child
                if n >= 2 and d + 1 < max_depth:
                    active.append(child)
            self.active = active


class _CacheTrie(_SuffixTrie):
    """The global suffix trie over finished requests' outputs: whole sequences in, the oldest
    out. Children are also kept in doubly linked sibling lists (to find a new best child and
    to drop subtrees), and freed node ids are reused. ``version`` changes with every change,
    so a request's cached match locations know when to be recomputed."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self._first = array("q", [-1])  # first child
        self._next = array("q", [-1])  # next sibling
        self._prev = array("q", [-1])  # previous sibling
        self._free: list[int] = []
        self.version = 0

    @property
    def num_nodes(self) -> int:
        """Stored nodes, the root excluded."""
        return len(self._count) - 1 - len(self._free)

    def _new_node(self, parent: int, token: int, ref: int, depth: int) -> int:
        """A child of ``parent`` for ``token`` with one occurrence, ``ref``."""
        first = self._first[parent]
        if self._free:
            nid = self._free.pop()
            self._count[nid] = 1
            self._token[nid] = token
            self._depth[nid] = depth
            self._ref[nid] = ref
            self._best[nid] = -1
            self._first[nid] = -1
            self._next[nid] = first
            self._prev[nid] = -1
        else:
            nid = len(self._count)
            self._count.append(1)
            self._token.append(token)
            self._depth.append(depth)
            self._ref.append(ref)
            self._best.append(-1)
            self._first.append(-1)
            self._next.append(first)
            self._prev.append(-1)
        if first >= 0:
            self._prev[first] = nid
        self._first[parent] = nid
        self._edges[(parent << _SHIFT) | token] = nid
        return nid

    def _step(self, node: int, token: int, ref: int) -> int:
        """Count occurrence ``ref`` (newer than all counted so far) of ``node``'s string
        followed by ``token``; return that child."""
        child = self._edges.get((node << _SHIFT) | token)
        count = self._count
        if child is None:
            child = self._new_node(node, token, ref, self._depth[node] + 1)
        else:
            n = count[child]
            if n == 1:
                self._split(child)
            count[child] = n + 1
            self._ref[child] = ref
        if node != _ROOT:
            best = self._best[node]
            if best < 0 or count[child] >= count[best]:  # the newest wins a tie
                self._best[node] = child
        return child

    def _split(self, node: int) -> None:
        """``node`` was seen once and is about to be seen again: store the next node of its one
        occurrence, so that every child of a node seen twice is stored."""
        depth = self._depth[node]
        if depth >= self.max_depth:
            return
        ref = self._ref[node]
        seq = self.seqs[ref >> _SHIFT]
        pos = (ref & _MASK) + depth
        if pos < len(seq):
            self._best[node] = self._new_node(node, seq[pos], ref, depth + 1)

    def _free_subtree(self, node: int) -> None:
        """Drop every stored node below ``node`` (not ``node`` itself)."""
        stack: list[tuple[int, int]] = []
        child = self._first[node]
        while child >= 0:
            stack.append((node, child))
            child = self._next[child]
        self._first[node] = -1
        self._best[node] = -1
        while stack:
            parent, x = stack.pop()
            child = self._first[x]
            while child >= 0:
                stack.append((x, child))
                child = self._next[child]
            del self._edges[(parent << _SHIFT) | self._token[x]]
            self._count[x] = 0
            self._best[x] = -1
            self._first[x] = -1
            self._free.append(x)

    def _free_node(self, parent: int, node: int) -> None:
        """Unlink ``node`` from ``parent`` and drop it with its subtree."""
        self._free_subtree(node)
        del self._edges[(parent << _SHIFT) | self._token[node]]
        prev, nxt = self._prev[node], self._next[node]
        if prev >= 0:
            self._next[prev] = nxt
        else:
            self._first[parent] = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
        self._count[node] = 0
        self._free.append(node)

    def _recompute_best(self, node: int) -> None:
        best, best_count, best_ref = -1, -1, -1
        child = self._first[node]
        while child >= 0:
            n, ref = self._count[child], self._ref[child]
            if n > best_count or (n == best_count and ref > best_ref):
                best, best_count, best_ref = child, n, ref
            child = self._next[child]
        self._best[node] = best

    def add(self, seq_no: int, tokens: list[int]) -> None:
        """Add sequence ``seq_no`` (larger than any added before): each suffix, cut to
        ``max_depth`` tokens, is counted down its path until a node it is the first to reach."""
        self.seqs[seq_no] = tokens
        step, count = self._step, self._count
        base = seq_no << _SHIFT
        n = len(tokens)
        for start in range(n):
            node = _ROOT
            ref = base | start
            for pos in range(start, min(n, start + self.max_depth)):
                node = step(node, tokens[pos], ref)
                if count[node] == 1:
                    break
        self.version += 1

    def remove(self, seq_no: int) -> None:
        """Remove sequence ``seq_no``, which must be the oldest here: then a node still counted
        has its most recent occurrence (``ref``) in a sequence that stays."""
        tokens = self.seqs[seq_no]
        count, best, edges = self._count, self._best, self._edges
        dirty: set[int] = set()  # nodes whose best child lost an occurrence
        n = len(tokens)
        for start in range(n):  # in order, so a node left with one occurrence has it in ref
            node = _ROOT
            for pos in range(start, min(n, start + self.max_depth)):
                child = edges[(node << _SHIFT) | tokens[pos]]
                left = count[child] - 1
                count[child] = left
                if node != _ROOT and best[node] == child:
                    dirty.add(node)
                if left == 0:  # this was its one occurrence
                    self._free_node(node, child)
                    break
                if left == 1:  # seen once now: a leaf pointing at the survivor, its ref
                    self._free_subtree(child)
                    break
                node = child
        del self.seqs[seq_no]
        for node in dirty:
            if count[node] >= 2:
                self._recompute_best(node)
        self.version += 1


def _to_token_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list of ints in [0, 2**32) (``ValueError`` otherwise)."""
    tolist = getattr(tokens, "tolist", None)
    out = tolist() if tolist is not None else list(map(operator.index, tokens))
    if out and (min(out) < 0 or max(out) > _MASK):
        raise ValueError("token_ids must be token ids in [0, 2**32).")
    return out


class _RequestState:
    __slots__ = ("trie", "cache_version", "cache_locs")

    def __init__(self, max_depth: int) -> None:
        self.trie = _RequestTrie(max_depth)
        self.cache_version = -1  # the global trie's version cache_locs were computed for
        # cache_locs[d]: the location in the global trie of the last d tokens (d = 0: root),
        # for every d whose string occurs there
        self.cache_locs: list[Location] = [(_ROOT, 0)]


class SuffixProposer:
    """vLLM's "suffix" method: suffix decoding over each request's own tokens and the outputs
    of earlier requests.

    Per call, for a request that gained t tokens: O(t * (1 + its longest repeated suffix)) to
    grow its trie, O(t * (1 + longest match)) to follow the global trie (O(max_depth * that)
    after the global trie changed), and O(k + max_depth) to draft. ``finish`` adds the output
    to the global trie (O(length * shared depth)) and evicts the oldest past
    ``suffix_decoding_max_cached_requests``. Memory: see ``_SuffixTrie`` (a few nodes of ~160
    bytes per token of each running request and each cached output).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "suffix":
            raise ValueError(f"SuffixProposer needs method 'suffix', got {config.method!r}.")
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.num_speculative_tokens = config.num_speculative_tokens
        self._requests: dict[str, _RequestState] = {}
        self._cache = _CacheTrie(self.max_depth)
        self._cached: deque[int] = deque()  # sequence numbers in the global trie, oldest first
        self._next_seq_no = 0

    @property
    def num_requests(self) -> int:
        """Requests with a trie here (proposed for and not finished)."""
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose outputs the global trie holds."""
        return len(self._cached)

    def _sync(self, req_id: str, token_ids: Sequence[int]) -> tuple[_RequestState, int]:
        """The request's state with ``token_ids`` ingested, and how many tokens were new."""
        state = self._requests.get(req_id)
        n = len(token_ids)
        if state is not None:
            seen = state.trie.tokens
            size = len(seen)
            if n < size or (size and token_ids[size - 1] != seen[size - 1]):
                state = None  # not a continuation of what we saw: start over
        size = 0 if state is None else len(state.trie.tokens)
        new = _to_token_list(token_ids[size:]) if n > size else []  # checked before any change
        if state is None:
            state = self._requests[req_id] = _RequestState(self.max_depth)
        state.trie.extend(new)
        return state, len(new)

    def _budget(self, match_len: int, k: int) -> tuple[int, int]:
        """The match length m <= ``match_len`` that allows the longest draft, and that length:
        max over m of min(k, floor(max_spec_factor * m), max_depth - m), the longest m on a tie.
        """
        best_m, best_b = 0, 0
        for m in range(match_len, 0, -1):
            cap = min(k, math.floor(self.max_spec_factor * m + 1e-9))
            if cap <= best_b:  # smaller m cannot beat it
                break
            b = min(cap, self.max_depth - m)
            if b > best_b:
                best_m, best_b = m, b
        return best_m, best_b

    def _cache_draft(self, state: _RequestState, num_new: int, k: int) -> tuple[list[int], float]:
        cache = self._cache
        if not cache.seqs:
            state.cache_version = -1
            return [], 0.0
        tokens = state.trie.tokens
        if state.cache_version != cache.version or num_new >= self.max_depth:
            locs: list[Location] = [(_ROOT, 0)]
            new = tokens[-self.max_depth :]
        else:
            locs = state.cache_locs
            new = tokens[len(tokens) - num_new :] if num_new else []
        advance = cache.advance
        for token in new:
            grown: list[Location] = [(_ROOT, 0)]
            for loc in locs:
                nxt = advance(loc, token)
                if nxt is None:  # a longer suffix cannot occur if this one does not
                    break
                grown.append(nxt)
            locs = grown
        state.cache_locs = locs
        state.cache_version = cache.version
        match_len = len(locs) - 1
        while match_len > 0 and not cache.has_continuation(locs[match_len]):
            match_len -= 1
        if match_len == 0:
            return [], 0.0
        m, budget = self._budget(match_len, k)
        if budget == 0:
            return [], 0.0
        return cache.draft(locs[m], budget, self.min_token_prob)

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        """Up to ``k`` draft tokens for ``req_id``: the better of its own trie's and the global
        trie's drafts (longer, then more probable); ``[]`` if neither matches."""
        k = check_k(k)
        state, num_new = self._sync(req_id, token_ids)
        if k == 0:
            state.cache_version = -1  # not followed this step: recompute next time
            return []
        trie = state.trie
        own: tuple[list[int], float] = ([], 0.0)
        match_len = len(trie.active) - 1  # each active string has a continuation
        if match_len > 0:
            m, budget = self._budget(match_len, k)
            if budget > 0:
                own = trie.draft((trie.active[m], 0), budget, self.min_token_prob)
        other = self._cache_draft(state, num_new, k)
        if (len(other[0]), other[1]) > (len(own[0]), own[1]):
            return other[0]
        return own[0]

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's trie; its output (``token_ids[num_prompt_tokens:]``) joins the
        global trie, whose oldest output leaves past ``suffix_decoding_max_cached_requests``."""
        self._requests.pop(req_id, None)
        if not 0 <= num_prompt_tokens <= len(token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [0, len(token_ids)={len(token_ids)}], "
                f"got {num_prompt_tokens!r}."
            )
        if self.max_cached_requests == 0:
            return
        output = _to_token_list(token_ids[num_prompt_tokens:])
        if not output:
            return
        seq_no = self._next_seq_no
        self._next_seq_no += 1
        self._cache.add(seq_no, output)
        self._cached.append(seq_no)
        while len(self._cached) > self.max_cached_requests:
            self._cache.remove(self._cached.popleft())
