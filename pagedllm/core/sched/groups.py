"""Parallel sampling: the n (or best_of) sequences of one request, sharing the prompt's blocks.

The request itself is sequence 0. Its prompt is prefilled once; the step that samples its
first token samples one token per sequence from the same logits (the runner does it), and
``fork`` then creates sequences 1..n-1 whose block tables share every block with sequence 0
(ref counts; a partly filled last block is copied on first write).

Seeding rule: sequence i of a request with seed s samples exactly as a single request with
seed s + i would, so each sequence is reproducible on its own.

Preemption is all-or-nothing: preempting one sequence preempts every running sequence of the
group (the paper's gang rule). After a recompute preemption each sequence resumes on its own,
sharing the prompt again through the prefix cache.
"""

from __future__ import annotations

import copy

from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.request import Request, RequestStatus


def num_sequences(request: Request) -> int:
    return request.sampling_params.num_sequences


class SequenceGroups:
    """Tracks the sequences of each request with more than one."""

    def __init__(self) -> None:
        self.members: dict[str, list[Request]] = {}  # parent id -> [seq 0, seq 1, ...]

    def register(self, request: Request) -> None:
        if num_sequences(request) > 1:
            request.parent_id = request.request_id
            request.seq_index = 0
            self.members[request.request_id] = [request]

    def group_of(self, request: Request) -> list[Request]:
        """Every live sequence of the request's group (just the request if it has none)."""
        if request.parent_id is None:
            return [request]
        return self.members.get(request.parent_id, [request])

    def expand_ids(self, request_ids: list[str]) -> list[str]:
        """A parent id stands for all its sequences (abort)."""
        out: list[str] = []
        for rid in request_ids:
            group = self.members.get(rid)
            out.extend([r.request_id for r in group] if group else [rid])
        return out

    def fork(self, parent: Request, tokens: list[int], kv: KVCacheManagerBase) -> list[Request]:
        """Create sequences 1..len(tokens) of ``parent`` from its just-computed prompt, each
        starting with its own first token; called before ``parent`` appends tokens[0]'s peer."""
        children = []
        for i, tok in enumerate(tokens, start=1):
            params = copy.copy(parent.sampling_params)
            params.n, params.best_of = 1, None
            if params.seed is not None:
                params.seed = params.seed + i
            child = Request(
                f"{parent.request_id}#{i}",
                parent.prompt_token_ids,
                params,
                eos_token_id=parent.eos_token_id,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
            )
            child.max_tokens = parent.max_tokens
            child.parent_id, child.seq_index = parent.request_id, i
            child.cache_salt = parent.cache_salt
            child.lora_request = parent.lora_request
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
            child.status = RequestStatus.RUNNING
            kv.fork(parent, child)
            child.append_output_token_ids(tok)
            children.append(child)
        self.members[parent.request_id].extend(children)
        return children

    def finished(self, request: Request) -> None:
        """Forget a finished sequence; the group goes when its last sequence does."""
        if request.parent_id is None:
            return
        group = self.members.get(request.parent_id)
        if group is None:
            return
        if request in group:
            group.remove(request)
        if not group:
            del self.members[request.parent_id]
