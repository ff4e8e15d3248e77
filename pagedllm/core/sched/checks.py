"""The two checks the scheduler makes on a request: can it ever be served (at admission), and
does a sampled token end it (after each step)."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def check_admissible(
    request: Request, max_num_seqs: int, max_model_len: int, capacity: int
) -> None:
    """Raise ValueError (the field named) if the request could never be served: more
    sequences than a batch holds, an empty prompt, a prompt longer than ``max_model_len`` or
    than the KV cache's ``capacity`` (tokens one request can hold alone). Then cap
    ``max_tokens`` so that the request alone always fits."""
    n = request.sampling_params.num_sequences
    if n > max_num_seqs:
        raise ValueError(
            f"n / best_of ({n}) is larger than max_num_seqs ({max_num_seqs}): the sequences "
            "could never run together."
        )
    if request.num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least one token.")
    if request.num_prompt_tokens > max_model_len:
        raise ValueError(
            f"prompt has {request.num_prompt_tokens} tokens, more than max_model_len "
            f"({max_model_len})."
        )
    if request.num_prompt_tokens + 1 > capacity:
        raise ValueError(
            f"prompt has {request.num_prompt_tokens} tokens but the KV cache holds only "
            f"{capacity} tokens in all; it could never be served."
        )
    request.max_tokens = min(request.max_tokens, capacity - request.num_prompt_tokens)


def check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Whether ``token`` (just appended) ends the request; sets its finished status and stop
    reason. EOS and stop tokens count only after ``min_tokens``; the length caps always."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
