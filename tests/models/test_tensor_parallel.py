"""Tensor parallelism on the CPU (issue 20): ``tensor_parallel_size`` 2 (two worker processes,
torch.distributed over gloo) gives the greedy tokens of one rank on every architecture,
including models with fewer KV heads than ranks (each KV head then on several ranks); seeded
sampling and logprobs agree; a model whose heads do not split is refused at start; a worker
killed mid-run fails the engine with a clear error, in bounded time.

fp32 on tiny random models: a rank's partial sums are added by the all-reduce in another
order than one matmul's, so logprobs agree to ~1e-5, and the peaky tiny models' greedy tokens
exactly.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def _prompts(n: int = 5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 500, int(rng.integers(8, 40))).tolist()}
            for _ in range(n)]  # fmt: skip


def _engine(path: str, tp: int, **kw: object) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=tp,
               **kw)  # fmt: skip


def _tokens(llm: LLM, prompts: list, params: object) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_every_arch(tiny_models, arch: str) -> None:
    """Greedy tokens with chunked prefill (a 16-token budget) and prefix hits; and the
    executor is the multiprocess one, one worker per rank."""
    path = tiny_models(arch)
    prompts = _prompts()
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7]})
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = {"max_num_batched_tokens": 16}
    want = _tokens(_engine(path, 1, **kw), prompts, sp)
    llm = _engine(path, 2, **kw)
    assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
    assert len(llm.llm_engine.engine_core.executor.pids) == 2
    assert _tokens(llm, prompts, sp) == want


@pytest.mark.parametrize(("kv_heads", "tp"), [(1, 2), (2, 4)], ids=["mqa-tp2", "gqa2-tp4"])
def test_fewer_kv_heads_than_ranks(tmp_path, kv_heads: int, tp: int) -> None:
    """One KV head over 2 ranks, two KV heads over 4 ranks: each rank loads its query heads
    and the one KV head they read (the shard the weight loader picks), and the tokens are
    those of one rank."""
    from tests.models.tiny import make_tiny_model

    path = make_tiny_model("llama", str(tmp_path / "m"), num_key_value_heads=kv_heads)
    prompts = _prompts(4, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _tokens(_engine(path, tp), prompts, sp) == _tokens(_engine(path, 1), prompts, sp)


def test_sampling_and_logprobs_agree(tiny_models) -> None:
    """Seeded temperature-1 sampling (every rank holds the whole logits and the same
    generator), n = 2, and logprobs of the sampled and top tokens."""
    path = tiny_models("qwen2")  # tied embeddings: the LM head is the vocab-split table
    prompts = _prompts(3, seed=2)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
    ]
    a = _engine(path, 1).generate(prompts, params, use_tqdm=False)
    b = _engine(path, 2).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
    for lx, ly in zip(a[2].outputs[0].logprobs, b[2].outputs[0].logprobs):
        assert lx.keys() == ly.keys()
        for tok in lx:
            assert ly[tok].logprob == pytest.approx(lx[tok].logprob, abs=1e-4)
    for px, py in zip(a[2].prompt_logprobs[1:], b[2].prompt_logprobs[1:]):
        assert px.keys() == py.keys()


def test_heads_that_do_not_split_are_refused(tiny_models) -> None:
    path = tiny_models("llama")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide"):
        _engine(path, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _engine(path, 2, distributed_executor_backend="uni")


def _fault_mid_run(llm: LLM, method: str, at_call: int, fault, limit_s: float) -> None:  # noqa: ANN001
    """Run ``fault(pids)`` when the executor's ``method`` is called the ``at_call``-th time
    during a generate: the generate must raise an error naming the dead rank 1 within
    ``limit_s``, and after shutdown no worker may be left (shutdown kills what does not exit
    in time)."""
    executor = llm.llm_engine.engine_core.executor
    pids = executor.pids
    original = getattr(executor, method)
    calls = [0]

    def faulty(so):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == at_call:
            fault(pids)
        return original(so)

    setattr(executor, method, faulty)
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    t = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 .* died"):
            llm.generate(_prompts(4), sp, use_tqdm=False)
        assert time.monotonic() - t < limit_s
    finally:
        llm.llm_engine.engine_core.shutdown()
    for pid in pids:  # no worker outlives the engine
        with pytest.raises(ProcessLookupError):
            for _ in range(300):
                os.kill(pid, 0)
                time.sleep(0.1)


def _kill_rank_1(pids: list[int]) -> None:
    os.kill(pids[1], signal.SIGKILL)


def test_killed_rank_fails_fast(tiny_models) -> None:
    """Rank 1 killed while requests run (a CPU engine runs synchronous steps): generate raises
    an error naming the dead worker within seconds (rank 0 may be blocked in a collective; it
    is stopped, not waited for)."""
    _fault_mid_run(_engine(tiny_models("llama"), 2), "execute_model", 3, _kill_rank_1, 60)


def test_dead_rank_found_while_another_is_stuck(tiny_models) -> None:
    """As on GPUs, where a rank whose peer died waits in a collective without failing: rank 0
    stopped (SIGSTOP: it never answers), rank 1 killed - the engine's wait for rank 0 still
    ends within seconds with an error naming rank 1, and shutdown stops the stuck rank."""

    def stop_0_kill_1(pids: list[int]) -> None:
        os.kill(pids[0], signal.SIGSTOP)
        os.kill(pids[1], signal.SIGKILL)

    _fault_mid_run(_engine(tiny_models("llama"), 2), "execute_model", 3, stop_0_kill_1, 30)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 GPUs"
)
def test_killed_rank_on_gpus_fails_fast(tiny_models) -> None:
    """On GPUs (async steps, CUDA graphs, the symmetric-memory all-reduce, whose kernel waits
    for its peers without a timeout): rank 1 killed mid-run - generate raises naming it within
    seconds, and shutdown removes rank 0, stuck on its GPU, too."""
    llm = LLM(tiny_models("llama"), dtype="float32", device="cuda", max_model_len=256,
              tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20)  # fmt: skip
    _fault_mid_run(llm, "launch_step", 5, _kill_rank_1, 60)


def _rank_argmax(monkeypatch, weight, x, rank: int, tp: int, gather) -> object:  # noqa: ANN001
    """LMHead.argmax as rank ``rank`` of ``tp`` would run it, ``gather`` standing in for the
    all-gather."""
    import torch

    from pagedllm.model.layers import embedding

    monkeypatch.setattr(embedding, "tp_info", lambda: (rank, tp))
    monkeypatch.setattr(embedding, "all_gather_last", gather)
    head = embedding.LMHead(weight.shape[0], weight.shape[1], torch.float32)
    head.weight_loader(head.weight, weight)
    return head.argmax(x)


@pytest.mark.parametrize(("vocab", "tp"), [(6, 2), (10, 4), (5, 4)])
def test_lm_head_argmax_across_ranks(monkeypatch, vocab: int, tp: int) -> None:
    """Greedy steps under TP gather each rank's (max, id), not the logits: the result is
    torch.argmax of the whole row, the first of equal maxima across ranks and within one,
    never a padding row (vocab 5 on 4 ranks: rank 3 holds only padding)."""
    import torch

    hidden = 4
    full = torch.randn(vocab, hidden)
    x = torch.randn(7, hidden)
    x[0] = 0  # every logit 0: a tie over the whole vocabulary -> id 0
    tied = full.clone()
    tied[vocab - 1] = tied[0]  # equal maxima in the first and last real rows (two ranks)
    for weight in (full, tied):
        want = torch.argmax(x @ weight.T, -1)
        parts = []
        for r in range(tp):  # every rank's (max, id) pairs
            record = lambda t: parts.append(t) or t.repeat(1, tp)  # noqa: B023, E731
            _rank_argmax(monkeypatch, weight, x, r, tp, record)
        gathered = torch.cat(parts, -1)
        for r in range(tp):  # each rank's answer from everyone's pairs
            got = _rank_argmax(monkeypatch, weight, x, r, tp, lambda t: gathered)  # noqa: B023
            assert got.dtype == torch.long and torch.equal(got, want), (r, got, want)
    assert torch.argmax(x @ tied.T, -1)[0] == 0
