"""``POST /v1/completions``: the legacy completions endpoint with vLLM's extras (echo, prompt
logprobs, ``best_of``, ``use_beam_search``, structured outputs, ``cache_salt``).

``n`` > 1 samples n sequences per prompt (sharing the prompt's KV blocks); ``best_of`` > n
samples best_of and returns the n with the highest cumulative logprob (non-streaming only, as in
vLLM). ``use_beam_search`` runs a beam search of width ``best_of`` (or ``n``) and returns the n
best hypotheses (non-streaming only).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.entrypoints.openai.protocol import CompletionRequest, now, random_id
from pagedllm.entrypoints.openai.serving import (
    Choice,
    Collected,
    Prompt,
    ServingBase,
    SSEStream,
    Started,
    clamp_logprob,
    off_loop,
    transfer_field,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

# token-id prompts up to this many ids in all are checked on the event loop (tens of
# microseconds); longer ones, and any text, go to the tokenizer thread
INLINE_IDS = 16384


def _ids_only(prompt: Any) -> bool:
    """Whether ``prompt`` (a completion request's) is token ids only, at most ``INLINE_IDS``."""
    if isinstance(prompt, str) or not prompt:
        return False
    if isinstance(prompt[0], int):
        return len(prompt) <= INLINE_IDS
    if any(isinstance(p, str) for p in prompt):
        return False
    return sum(map(len, prompt)) <= INLINE_IDS


class ServingCompletion(ServingBase):
    """The legacy completions endpoint, with vLLM's extras (echo, prompt logprobs, ...)."""

    def tokenize(self, req: CompletionRequest, max_tokens: int | None) -> list[Prompt]:
        """(prompt text, ids) per prompt, each checked against the context length."""
        prompts: list[Prompt] = []
        check = SamplingParams(max_tokens=max_tokens)
        for p in req.prompts():
            if isinstance(p, str):
                self.check_text_fits(len(p), "prompt")
                ids = list(self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens))
                text: str | None = p
            else:
                ids, text = list(p), None
            self.check_length(len(ids), max_tokens, "prompt")
            try:
                text, ids = self.llm.validate({"prompt": text, "prompt_token_ids": ids}, check)
            except ValueError as e:
                raise RequestError(str(e), param="prompt") from e
            prompts.append((text, ids))
        return prompts

    def prepare(self, req: CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        """Check and tokenize: ((prompt text, ids) per prompt, sampling params)."""
        self.check_model(req.model)
        params = req.to_sampling_params()
        best_of = params.best_of or params.n
        self.check_num_seqs(best_of, "best_of" if best_of > params.n else "n")
        if req.kv_transfer_params and len(req.prompts()) > 1:
            raise RequestError(
                "kv_transfer_params needs a single prompt (one KV transfer per request).",
                param="kv_transfer_params",
            )
        return self.tokenize(req, req.max_tokens), params

    async def create(self, req: CompletionRequest) -> dict[str, Any] | SSEStream:
        """The response body (dict) or, when streaming, an SSE text iterator."""
        if req.use_beam_search:
            return await self._beam_search(req)
        if _ids_only(req.prompt):  # nothing to tokenize: checked here, no thread hop
            prompts, params = self.prepare(req)
        else:
            prompts, params = await off_loop(self.prepare, req)
        await self.check_structured(params, req.structured_field)
        rid = random_id("cmpl")
        best_of = (params.best_of or params.n) > params.n  # the engine picks the n best at the end
        started = await self.start(prompts, params, rid, req.priority, req.cache_salt, req.n,
                                   "final" if best_of else "delta",
                                   self.check_model(req.model))  # fmt: skip
        created = now()
        if req.stream:
            return self._stream(req, started, rid, created)
        return self._response(req, await self.collect(started), rid, created)

    async def _beam_search(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        params = req.to_beam_search_params(16)
        self.check_num_seqs(params.beam_width, "best_of" if req.best_of else "n")
        prompts = await off_loop(self.tokenize, req, params.max_tokens)
        rid = random_id("cmpl")
        started = await self.start(prompts, params, rid, n=req.n,
                                   lora_request=self.check_model(req.model))  # fmt: skip
        return self._response(req, await self.collect(started), rid, now())

    def _response(
        self, req: CompletionRequest, results: list[Collected], rid: str, created: int
    ) -> dict[str, Any]:
        choices = []
        for p, r in enumerate(results):
            for c in r.ordered(req.n):
                text, logprobs = c.text, None
                if req.echo:
                    text = self._prompt_text(r.prompt_text, r.prompt_token_ids) + c.text
                if req.logprobs is not None:
                    logprobs = self._logprobs(r, c, req.logprobs, req.echo, 0)
                choice = {
                    "index": p * req.n + c.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.return_token_ids:  # vLLM's extra
                    choice["prompt_token_ids"] = r.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.reply_model(req.model),
            "choices": choices,
            "usage": self.usage(results, req.n),
            **transfer_field(results),
        }

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def _stream(
        self, req: CompletionRequest, started: list[Started], rid: str, created: int
    ) -> SSEStream:
        offsets: dict[int, int] = {}  # text already sent per choice (for text_offset)

        def chunk(index: int, text: str, logprobs: Any, fr: Any, sr: Any) -> dict[str, Any]:
            c: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.reply_model(req.model),
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": fr,
                        "stop_reason": sr,
                    }
                ],
            }
            if req.include_usage:
                c["usage"] = None
            return c

        def make_chunks(s: Started, c: CompletionOutput, out: RequestOutput
                        ) -> list[dict[str, Any]]:  # fmt: skip
            index = s.choice_index(c.index)
            first = index not in offsets
            echo_now = req.echo and first
            offset = offsets.setdefault(index, 0)
            text = c.text
            col = Collected(s.prompt_text, s.prompt_token_ids)
            if echo_now:  # like vLLM: the prompt rides on the first chunk of its choice
                text = self._prompt_text(s.prompt_text, s.prompt_token_ids) + text
                col.prompt_logprobs = out.prompt_logprobs
            if not text and c.finish_reason is None and (req.logprobs is None or not c.token_ids):
                if not (req.return_token_ids and c.token_ids):
                    return []
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._logprobs(col, Choice.of(c), req.logprobs, echo_now, offset)
            offsets[index] = offset + len(text)
            made = chunk(index, text, logprobs, c.finish_reason, c.stop_reason)
            if req.return_token_ids:  # vLLM's: the prompt's ids ride on a choice's first chunk
                if first:
                    made["choices"][0]["prompt_token_ids"] = s.prompt_token_ids
                made["choices"][0]["token_ids"] = list(c.token_ids)
            return [made]

        usage_chunk = self.usage_chunk(rid, "text_completion", created, req.model)
        return self.stream_events(
            started,
            make_chunks,
            lambda s: [],
            usage_chunk if req.include_usage else None,
            req.continuous_usage,
        )

    def _logprobs(
        self, r: Collected, c: Choice, num: int, echo: bool, offset: int
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs object of choice ``c`` of request ``r``: tokens,
        token_logprobs, top_logprobs, text_offset (character offsets into the choice's text,
        starting at ``offset``); with ``echo`` the prompt's tokens come first."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        rows: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo:
            plp = r.prompt_logprobs or [None] * len(r.prompt_token_ids)
            rows.extend(zip(r.prompt_token_ids, plp))
        rows.extend(zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
        for tid, d in rows:
            lp = d.get(tid) if d else None
            tokens.append(self.token_str(tid, lp))
            token_lps.append(clamp_logprob(lp.logprob) if lp is not None else None)
            if d is None:
                tops.append(None)
                continue
            top = sorted(d.items(), key=lambda kv: kv[1].rank or 0)
            entries = [(t, x) for t, x in top if (x.rank or 0) <= num or t == tid]
            tops.append({self.token_str(t, x): clamp_logprob(x.logprob) for t, x in entries})
        text_offset = []
        pos = offset
        for t in tokens:
            text_offset.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": text_offset,
        }
