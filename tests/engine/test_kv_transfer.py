"""Prefill/decode disaggregation (``kv_transfer_config``, issue 54): a producer engine computes
the prompt and hands its KV over through shared-memory files, a consumer engine continues from
it. The pair's greedy tokens and logprobs equal one engine's on every architecture; a consumer
that caches a prefix reads only the rest; a transfer that is missing, truncated, of another
prompt or of another model fails its request alone, with the reason; settings are checked."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_transfer.scheduler import KVTransferScheduler

BLOCK = 16
HANDOVER = SamplingParams(
    temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


def _llm(tiny_models: Callable[[str], str], arch: str, role: str | None, buf: Path,
         buffer: float | None = None, **kw: Any) -> LLM:  # fmt: skip
    """A tiny engine; with a ``role``, a KV transfer config in ``buf`` whose engine id is the
    role's second word and whose ``kv_buffer_size`` is ``buffer`` (None: the device's
    default)."""
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 64, "max_num_seqs": 4, **kw}
    if role is not None:
        kw["kv_transfer_config"] = {"kv_role": role, "kv_buffer_path": str(buf),
                                    "engine_id": role.split("_")[1],
                                    "kv_buffer_size": buffer}  # fmt: skip
    kw.setdefault("device", "cpu")
    return LLM(tiny_models(arch), dtype="float32", seed=0, **kw)


def _decode(params: dict | None, n: int = 12) -> SamplingParams:
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0,
                          extra_args=extra)  # fmt: skip


def _tokens(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]


def _role(llm: LLM) -> KVTransferScheduler:
    core = llm.llm_engine.engine_core
    return next(c for c in core.scheduler.connectors if isinstance(c, KVTransferScheduler))


def _equals_one_engine(
    consumer: LLM, tiny_models: Callable[[str], str], arch: str, buf: Path,
    prompts: list[list[int]], params: list[dict], **kw: Any,
) -> None:  # fmt: skip
    """The consumer's greedy tokens and logprobs for ``prompts`` with the producer's
    ``params`` are those of one engine (``kw``: its settings) that computes everything."""
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [_decode(p) for p in params], use_tqdm=False)  # fmt: skip
    ref = _llm(tiny_models, arch, None, buf, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False
    )
    for g, r in zip(got, ref):
        (toks, lps), (ref_toks, ref_lps) = _tokens(g), _tokens(r)
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)


def _hand_over(producer: LLM, prompts: list[list[int]]) -> list[dict]:
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], HANDOVER,
                             use_tqdm=False)  # fmt: skip
    return [o.kv_transfer_params for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_a_prefill_decode_pair_equals_one_engine(tiny_models, tmp_path, arch):
    """Three prompts (150, 37 and 16 tokens: a partial last block, one of a block and less
    than a prompt's last token) prefilled by the producer (chunks of 32 tokens: Gemma 3's
    window layers drop blocks while the prompt runs) and decoded by the consumer: the tokens
    and logprobs of one engine, the consumer computing only each prompt's tail."""
    prompts = [_prompt(1, 150), _prompt(2, 37), _prompt(3, 16)]
    kw = {"max_num_batched_tokens": 32}
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path, **kw)
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path, **kw)
    params = _hand_over(producer, prompts)
    assert params[0] == {
        "do_remote_prefill": True, "remote_engine_id": "producer",
        "remote_block_file": params[0]["remote_block_file"],
    }  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == sorted(p["remote_block_file"] + ".r0" for p in params)
    _equals_one_engine(consumer, tiny_models, arch, tmp_path, prompts, params, **kw)
    # (150 - 1) // 16 = 9 blocks, (37 - 1) // 16 = 2, (16 - 1) // 16 = 0
    assert _role(consumer).received_tokens == (9 + 2) * BLOCK
    assert os.listdir(tmp_path) == []  # the consumer deleted what it read


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_transfers_go_through_the_ring_a_block_at_a_time(tiny_models, tmp_path, monkeypatch, arch):
    """A ring buffer of one row: every read and write is a chunk of one block (the path of a
    transfer larger than the ring); the tokens are still one engine's."""
    from pagedllm.worker.kv_transfer import KVTransferWorker

    monkeypatch.setattr(KVTransferWorker, "RING_BYTES", 1)
    prompts = [_prompt(40, 150), _prompt(41, 70)]
    kw = {"max_num_batched_tokens": 32}
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path, **kw)
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path, **kw)
    params = _hand_over(producer, prompts)
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [_decode(p) for p in params], use_tqdm=False)  # fmt: skip
    ref = _llm(tiny_models, arch, None, tmp_path, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False
    )
    assert [_tokens(g)[0] for g in got] == [_tokens(r)[0] for r in ref]
    assert _role(consumer).received_tokens == (9 + 4) * BLOCK


@pytest.mark.parametrize("buffer", [0, 1 << 22], ids=["file", "buffer"])
def test_a_consumer_with_the_prefix_cached_reads_only_the_rest(tiny_models, tmp_path, buffer):
    """The consumer served a 100-token prompt before; a 150-token prompt that starts with it
    hits its 6 cached blocks and takes blocks 6..8 from the transfer (its file's rows, or
    rows 6..8 of the producer's buffer range)."""
    shared = _prompt(4, 100)
    prompt = shared + _prompt(5, 50)
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path, buffer)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path)
    consumer.generate([{"prompt_token_ids": shared}], _decode(None, 1), use_tqdm=False)
    (params,) = _hand_over(producer, [prompt])
    assert _role(producer).buffered_transfers == int(buffer > 0)
    (got,) = consumer.generate([{"prompt_token_ids": prompt}], _decode(params), use_tqdm=False)
    assert got.num_cached_tokens == 6 * BLOCK + 3 * BLOCK
    assert _role(consumer).received_tokens == 3 * BLOCK
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False
    )
    assert _tokens(got)[0] == _tokens(ref)[0]


def test_a_consumer_takes_its_device_then_its_host_tier_then_the_transfer(tiny_models, tmp_path):
    """A consumer with a host tier served a 100-token prompt, then others that pushed it out
    of its 24-block device pool: a 150-token prompt starting with it takes its 6 blocks from
    the tier and blocks 6..8 from the transfer (the hits chain: each role's starts where the
    ones before end), with one engine's tokens."""
    from pagedllm.core.sched.offload import OffloadScheduler

    shared = _prompt(30, 100)
    prompt = shared + _prompt(31, 50)
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path, kv_offloading_size=0.01,
                    num_gpu_blocks_override=24, max_num_seqs=1)  # fmt: skip
    for p in [shared] + [_prompt(s, 150) for s in (32, 33, 34)]:
        consumer.generate([{"prompt_token_ids": p}], _decode(None, 1), use_tqdm=False)
    (params,) = _hand_over(producer, [prompt])
    (got,) = consumer.generate([{"prompt_token_ids": prompt}], _decode(params), use_tqdm=False)
    core = consumer.llm_engine.engine_core
    tier = next(c for c in core.scheduler.connectors if isinstance(c, OffloadScheduler))
    assert tier.hit_tokens == 6 * BLOCK
    assert _role(consumer).received_tokens == 3 * BLOCK
    assert got.num_cached_tokens == 9 * BLOCK
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False
    )
    assert _tokens(got)[0] == _tokens(ref)[0]


def _refused(consumer: LLM, prompt: list[int], params: dict) -> str:
    with pytest.raises(ValueError) as e:
        consumer.generate([{"prompt_token_ids": prompt}], _decode(params), use_tqdm=False)
    return str(e.value)


def test_a_bad_transfer_fails_its_request_alone(tiny_models, tmp_path):
    """Missing (the producer died or timed out), truncated (it died while writing), of another
    prompt, taken twice, or a file name with a path: each request is refused with the reason,
    its claimed file is gone, and the consumer then serves a good transfer exactly."""
    prompts = [_prompt(s, 150) for s in (6, 7, 8)]
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path)
    a, b, c = _hand_over(producer, prompts)
    missing = {**a, "remote_block_file": "producer-gone.kv"}
    assert "is not in" in _refused(consumer, prompts[0], missing)
    path = tmp_path / (b["remote_block_file"] + ".r0")
    path.write_bytes(path.read_bytes()[:-100])
    assert "truncated" in _refused(consumer, prompts[1], b)
    assert "another prompt" in _refused(consumer, prompts[1], c)  # c is prompts[2]'s
    assert "is not in" in _refused(consumer, prompts[2], c)  # (the last refusal deleted it)
    assert "file name" in _refused(consumer, prompts[0], {**a, "remote_block_file": "../x"})
    assert _role(consumer).refused_transfers == 4  # (a bad name is refused before a claim)
    assert sorted(os.listdir(tmp_path)) == [a["remote_block_file"] + ".r0"]
    (got,) = consumer.generate([{"prompt_token_ids": prompts[0]}], _decode(a), use_tqdm=False)
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompts[0]}], _decode(None), use_tqdm=False
    )
    assert _tokens(got)[0] == _tokens(ref)[0]
    assert _role(consumer).received_tokens == 9 * BLOCK


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_load_that_fails_after_its_claim_ends_its_request_and_its_sharers_alone(
    tiny_models, tmp_path, monkeypatch, arch
):
    """A claimed transfer whose load then fails (here: its read raises) ends its request with
    the reason; a request that hit its blocks in the prefix cache in the same step ends too,
    a request beside them with its own transfer decodes exactly, and the blocks leave the
    prefix cache: the same prompt computed afterwards gives one engine's tokens (before the
    isolation, the step failed and took every running request with it)."""
    from pagedllm.worker.kv_transfer import KVTransferWorker

    prompts = [_prompt(11, 150), _prompt(12, 150)]
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path)
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path)
    bad, good = _hand_over(producer, prompts)
    load_one = KVTransferWorker._load_one

    def failing(self: Any, load: Any, stream: Any) -> tuple[int, float]:
        if bad["remote_block_file"] in load.path:
            raise OSError("injected read error")
        return load_one(self, load, stream)

    monkeypatch.setattr(KVTransferWorker, "_load_one", failing)
    outs = consumer.generate(
        [{"prompt_token_ids": p} for p in (prompts[0], prompts[1], prompts[0])],
        [_decode(bad), _decode(good), _decode(None)],
        use_tqdm=False,
    )
    assert "could not be loaded: injected read error" in outs[0].error
    ref = _llm(tiny_models, arch, None, tmp_path).generate(
        [{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False
    )
    assert outs[1].error is None and _tokens(outs[1])[0] == _tokens(ref[1])[0]
    # the third: a prefix hit on the failed blocks ends it (the plain manager hits them in
    # the same step; Gemma 3's window group has none of them cached yet, so it computes)
    if arch == "llama" or outs[2].error is not None:
        assert "shared KV blocks" in outs[2].error
    else:
        assert _tokens(outs[2])[0] == _tokens(ref[0])[0]
    assert os.listdir(tmp_path) == []  # the failed load's file went too
    (again,) = consumer.generate([{"prompt_token_ids": prompts[0]}], _decode(None),
                                 use_tqdm=False)  # fmt: skip
    assert again.error is None and _tokens(again)[0] == _tokens(ref[0])[0]
    core = consumer.llm_engine.engine_core
    core.scheduler.kv_cache_manager.check_integrity()


def test_a_failed_load_under_kv_compress_fails_its_step_and_the_engine_goes_on(
    tiny_models, tmp_path, monkeypatch
):
    """KV-Compress's per-head blocks have no per-request isolation yet: a failed load fails
    the step (every running request ends, the caller hears why), and the engine then serves
    the same prompt exactly."""
    from pagedllm.worker.kv_transfer import KVTransferWorker

    prompts = [_prompt(11, 150), _prompt(12, 150)]
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path, enable_kvc=True)
    bad, good = _hand_over(producer, prompts)

    def failing(self: Any, load: Any, stream: Any) -> None:
        raise OSError("injected read error")

    monkeypatch.setattr(KVTransferWorker, "_load_one", failing)
    with pytest.raises(RuntimeError, match="KV transfer loads failed .*injected read error"):
        consumer.generate([{"prompt_token_ids": p} for p in prompts],
                          [_decode(bad), _decode(good)], use_tqdm=False)  # fmt: skip
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    (again,) = consumer.generate([{"prompt_token_ids": prompts[0]}], _decode(None),
                                 use_tqdm=False)  # fmt: skip
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompts[0]}], _decode(None), use_tqdm=False
    )
    assert again.error is None and _tokens(again)[0] == _tokens(ref)[0]


def test_a_failed_load_leaves_nothing_in_the_host_tier(tiny_models, tmp_path, monkeypatch):
    """A consumer with a host tier: the write-through saved the failed load's blocks in that
    step; the failure makes the tier forget them, so the prompt computed afterwards takes
    nothing from the tier and gives one engine's tokens."""
    from pagedllm.core.sched.offload import OffloadScheduler
    from pagedllm.worker.kv_transfer import KVTransferWorker

    prompt = _prompt(13, 150)
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path, kv_offloading_size=0.01,
                    num_gpu_blocks_override=24, max_num_seqs=1)  # fmt: skip
    tier = next(c for c in consumer.llm_engine.engine_core.scheduler.connectors
                if isinstance(c, OffloadScheduler))  # fmt: skip
    (params,) = _hand_over(producer, [prompt])

    def failing(self: Any, load: Any, stream: Any) -> None:
        raise EOFError("a KV transfer ended 100 bytes early")

    monkeypatch.setattr(KVTransferWorker, "_load_one", failing)
    (out,) = consumer.generate([{"prompt_token_ids": prompt}], _decode(params), use_tqdm=False)
    assert "ended 100 bytes early" in out.error
    assert tier.saved_blocks >= 9 and not tier.entries and not tier.busy
    monkeypatch.undo()
    (got,) = consumer.generate([{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False)
    assert tier.hit_tokens == 0 and got.num_cached_tokens == 0
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False
    )
    assert _tokens(got)[0] == _tokens(ref)[0]
    # an entry still landing (its copy in flight) when forgotten: its host block is freed
    # once the copy is done, not before
    key, host = next(iter(tier.entries.items()))
    tier.landing[host], tier.busy[host] = key, 1
    tier.on_cache_invalid([key])
    assert key not in tier.entries and host not in tier.landing and host not in tier.free
    tier.update(type(tier.planned)(saves=[(0, host)]), None)
    assert host in tier.free and not tier.busy


def test_a_transfer_of_another_model_shape_is_refused(tiny_models, tmp_path):
    """A producer of another architecture (another KV layout): refused, naming the layouts."""
    prompt = _prompt(9, 60)
    (params,) = _hand_over(_llm(tiny_models, "qwen3", "kv_producer", tmp_path), [prompt])
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path)
    assert "another KV layout" in _refused(consumer, prompt, params)


def test_unclaimed_transfers_expire_and_roles_are_checked(tiny_models, tmp_path):
    """A producer deletes its transfers nobody claimed within kv_transfer_timeout; a consumer
    refuses do_remote_decode and a producer do_remote_prefill; bad configs name the field."""
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path,
                    kv_transfer_config={"kv_role": "kv_producer", "kv_buffer_path": str(tmp_path),
                                        "engine_id": "p", "kv_transfer_timeout": 0.01})  # fmt: skip
    (params,) = _hand_over(producer, [_prompt(10, 40)])
    old = tmp_path / (params["remote_block_file"] + ".r0")
    os.utime(old, (0, 0))
    role = _role(producer)
    role._next_sweep = 0.0
    _hand_over(producer, [_prompt(11, 40)])  # its step sweeps
    assert not old.exists() and len(os.listdir(tmp_path)) == 1
    with pytest.raises(ValueError, match="not a KV producer"):
        _llm(tiny_models, "llama", "kv_consumer", tmp_path).generate(
            [{"prompt_token_ids": _prompt(12, 20)}], HANDOVER, use_tqdm=False
        )
    with pytest.raises(ValueError, match="not a KV consumer"):
        producer.generate([{"prompt_token_ids": _prompt(12, 20)}], _decode(params),
                          use_tqdm=False)  # fmt: skip
    for bad, field in (
        ({"kv_role": "prefill"}, "kv_role"),
        ({"kv_role": "kv_both", "kv_connector": "NixlConnector"}, "kv_connector"),
        ({"kv_role": "kv_both", "kv_transfer_timeout": 0}, "kv_transfer_timeout"),
        ({"kv_role": "kv_both", "engine_id": "a/b"}, "engine_id"),
        ({"kv_role": "kv_both", "colour": 1}, "unknown keys"),
        ("{not json", "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=field):
            LLM(tiny_models("llama"), device="cpu", kv_transfer_config=bad)


def _kvc_decode(params: dict | None, budget: int) -> SamplingParams:
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0,
                          extra_args=extra, max_cache_tokens=budget,
                          protected_window_size=8)  # fmt: skip


@pytest.mark.parametrize(
    "arch,dtype,buffer", [("llama", "auto", 0), ("gemma3", "auto", 0), ("qwen3", "fp8", 1 << 22)]
)
def test_kv_compress_on_a_pair_equals_one_engine(tiny_models, tmp_path, arch, dtype, buffer):
    """KV-Compress with prefill/decode disaggregation. The producer hands its prompts' KVs
    over whole (a request it hands over is never evicted there), gathered from the per-head
    blocks into the plain layout's rows; the consumer loads them into its per-head blocks,
    computes each prompt's last 32 tokens itself (their queries score every key, as one
    engine's last chunk's do) and evicts to its budget. Tokens and logprobs are one
    KV-Compress engine's, with a budget that evicts nothing and with one that evicts; a
    producer without KV-Compress feeds the consumer the same rows (Gemma 3's plain engine,
    whose window layers have a table of their own, is refused by layout). An fp8 cache's rows
    move as bytes, through the producer's buffer (``kv_buffer_size``)."""
    blocks = {"num_gpu_blocks_override": 1024, "kv_cache_dtype": dtype}  # (one-head blocks)
    kvc = {"enable_kvc": True, "max_num_batched_tokens": 256, **blocks}
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path, buffer, enable_kvc=True,
                    max_num_batched_tokens=32, **blocks)  # fmt: skip
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path, **kvc)
    single = _llm(tiny_models, arch, None, tmp_path, **kvc)
    manager = consumer.llm_engine.engine_core.scheduler.kv_cache_manager
    for seed, budget in ((20, 200), (30, 24)):
        prompts = [_prompt(seed, 150), _prompt(seed + 1, 70), _prompt(seed + 2, 20)]
        params = _hand_over(producer, prompts)
        assert producer.llm_engine.engine_core.scheduler.kv_cache_manager.num_evicted_kvs == 0
        assert _role(producer).buffered_transfers == (3 if seed == 20 else 6) * bool(buffer)
        evicted = manager.num_evicted_kvs
        decode = [_kvc_decode(p, budget) for p in params]
        got = consumer.generate([{"prompt_token_ids": p} for p in prompts], decode,
                                use_tqdm=False)  # fmt: skip
        ref = single.generate([{"prompt_token_ids": p} for p in prompts],
                              _kvc_decode(None, budget), use_tqdm=False)  # fmt: skip
        for g, r in zip(got, ref):
            (toks, lps), (ref_toks, ref_lps) = _tokens(g), _tokens(r)
            assert toks == ref_toks
            np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)
        assert (manager.num_evicted_kvs > evicted) == (budget < 150)
        consumer.llm_engine.engine_core.check_integrity()
    # (150 - 32) // 16 = 7 blocks, (70 - 32) // 16 = 2, a 20-token prompt none: twice
    assert _role(consumer).received_tokens == 2 * (7 + 2) * BLOCK
    assert [n for n in os.listdir(tmp_path) if ".arena." not in n] == []
    plain = _llm(tiny_models, arch, "kv_producer", tmp_path, kv_cache_dtype=dtype)
    prompt = _prompt(40, 100)
    (params,) = _hand_over(plain, [prompt])
    if arch == "gemma3":
        assert "another KV layout" in _refused(consumer, prompt, params)
        return
    (got,) = consumer.generate([{"prompt_token_ids": prompt}], _kvc_decode(params, 24),
                               use_tqdm=False)  # fmt: skip
    (ref,) = single.generate([{"prompt_token_ids": prompt}], _kvc_decode(None, 24),
                             use_tqdm=False)  # fmt: skip
    assert _tokens(got)[0] == _tokens(ref)[0]


def test_a_pair_with_tensor_parallelism(tiny_models, tmp_path):
    """TP=2 (gloo), with KV-Compress, one engine in both roles (no prefix cache: its consumer
    side reads the whole transfer), through its buffer: each rank gathers into and scatters
    from its own buffer (a shared-memory file per rank, the rows at the one range the
    scheduler placed for both) its own KV heads' blocks, whose ids the scheduler numbers over
    both ranks' pools, and each rank's header-only file goes once it has copied (the plain
    layout's shards through files: the DCP pair of
    ``tests/models/test_decode_context_parallel.py``); the tokens are one engine's without
    KV-Compress (a budget that evicts nothing)."""
    prompt = _prompt(13, 100)
    kw = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enable_kvc": True,
          "num_gpu_blocks_override": 1024, "max_num_batched_tokens": 64,
          "enable_prefix_caching": False}  # fmt: skip
    both = _llm(tiny_models, "llama", "kv_both", tmp_path, 1 << 22, **kw)
    try:
        (params,) = _hand_over(both, [prompt])
        assert _role(both).buffered_transfers == 1
        files = [params["remote_block_file"] + f".r{r}" for r in range(2)]
        assert sorted(n for n in os.listdir(tmp_path) if ".arena." not in n) == files
        assert all(os.path.getsize(tmp_path / f) <= 4096 for f in files)
        (got,) = both.generate([{"prompt_token_ids": prompt}], _decode(params), use_tqdm=False)
        # KV-Compress computes the last 32 tokens: (100 - 32) // 16 = 4 blocks
        assert _role(both).received_tokens == 4 * BLOCK
        assert [n for n in os.listdir(tmp_path) if ".arena." not in n] == []
    finally:
        both.llm_engine.engine_core.shutdown()
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False
    )
    assert _tokens(got)[0] == _tokens(ref)[0]


def test_a_load_that_fails_on_one_tensor_parallel_rank_fails_its_request_on_all(
    tiny_models, tmp_path
):
    """TP=2 (gloo), files: rank 1's file of a claimed transfer is gone before its load, rank
    0's is there. The ranks merge their failures (one all-reduce), so the request ends with
    the reason on both - rank 0's blocks alone would hold the right KVs, rank 1's not - and a
    request beside it in the same step decodes exactly; both ranks' files are gone after."""
    prompts = [_prompt(14, 100), _prompt(15, 100)]
    kw = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
          "num_gpu_blocks_override": 512, "enable_prefix_caching": False}  # fmt: skip
    both = _llm(tiny_models, "llama", "kv_both", tmp_path, 0, **kw)
    try:
        bad, good = _hand_over(both, prompts)
        engine = both.llm_engine
        engine.add_request("bad", {"prompt_token_ids": prompts[0]}, _decode(bad))
        engine.add_request("good", {"prompt_token_ids": prompts[1]}, _decode(good))
        # claimed: each rank's file renamed with the consumer's id
        claimed = bad["remote_block_file"] + ".r1."
        (rank1,) = [n for n in os.listdir(tmp_path) if n.startswith(claimed)]
        os.unlink(tmp_path / rank1)
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert "failed on another rank" in done["bad"].error
        assert done["good"].error is None
        assert os.listdir(tmp_path) == []
    finally:
        both.llm_engine.engine_core.shutdown()
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompts[1]}], _decode(None), use_tqdm=False
    )
    assert _tokens(done["good"])[0] == _tokens(ref)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("buffer", [0, None], ids=["file", "buffer"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_on_a_gpu_a_pair_equals_one_engine(tiny_models, tmp_path, arch, buffer):
    """Two engines sharing one GPU (async scheduling, CUDA graphs): the producer's rows are
    gathered on the device and written from pinned memory, the consumer's go back through
    pinned memory (``kv_buffer_size`` 0); or (the default) they stay in the producer's
    device buffer, which the consumer (in the same process: no IPC) reads. The reference
    is one engine that ran the prompts once, as the producer did, and then hits its own
    prefix cache, computing each prompt's tail as the consumer does
    (the same kernels on the same shapes: a GPU's sums depend on them): the consumer's tokens
    and logprobs are that engine's, so the KV that crossed is the KV it cached."""
    prompts = [_prompt(20, 150), _prompt(21, 70)]
    kw = {"device": "cuda", "max_num_batched_tokens": 32}
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path, buffer, **kw)
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path, **kw)
    params = _hand_over(producer, prompts)
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [_decode(p) for p in params], use_tqdm=False)  # fmt: skip
    one = _llm(tiny_models, arch, None, tmp_path, **kw)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    one.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
    ref = one.generate([{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False)
    for g, r in zip(got, ref):
        assert g.num_cached_tokens == r.num_cached_tokens
        (toks, lps), (ref_toks, ref_lps) = _tokens(g), _tokens(r)
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)
    assert _role(consumer).received_tokens == (9 + 4) * BLOCK
    assert _role(producer).buffered_transfers == (0 if buffer == 0 else 2)


def test_parallel_sampling_on_the_consumer_equals_one_engine(tiny_models, tmp_path):
    """n = 3 seeded samples on the consumer: the request loads the transfer once, its
    sequences fork from it; each sample is one engine's."""
    prompt = _prompt(50, 150)
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path)
    (params,) = _hand_over(producer, [prompt])
    sp = {"temperature": 0.8, "seed": 7, "max_tokens": 10, "n": 3, "ignore_eos": True}
    extra = {"kv_transfer_params": params}
    (got,) = consumer.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(**sp, extra_args=extra), use_tqdm=False)  # fmt: skip
    (ref,) = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(**sp), use_tqdm=False
    )
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert len({tuple(c.token_ids) for c in got.outputs}) == 3
    assert _role(consumer).received_tokens == 9 * BLOCK


@pytest.mark.parametrize(
    "consumer_kw",
    [
        {"async_scheduling": True},
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 3,
            }
        },  # fmt: skip
    ],
    ids=["async", "ngram"],
)
def test_a_consumer_with_async_scheduling_or_drafts_equals_one_engine(tiny_models, tmp_path,
                                                                      consumer_kw):  # fmt: skip
    """The loads happen in the step that admits the request, whatever runs around it: under
    async scheduling, or with n-gram drafts verified after the transfer, the tokens are one
    engine's."""
    prompts = [_prompt(60, 150), _prompt(61, 90)]
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path)
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path, **consumer_kw)
    params = _hand_over(producer, prompts)
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [_decode(p) for p in params], use_tqdm=False)  # fmt: skip
    ref = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False
    )
    assert [_tokens(g)[0] for g in got] == [_tokens(r)[0] for r in ref]
    assert _role(consumer).received_tokens == (9 + 5) * BLOCK


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)], ids=["one_rank", "rank1_of_2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_per_head_blocks_move_as_plain_rows(device, world, rank, dtype):
    """``HeadRows`` against a plain cache built by hand: gathering rows from one-head blocks
    gives, per layer, the ``[2, block_size, kv_heads, head_dim]`` page a plain cache holds
    for those tokens (so an engine without KV-Compress reads them); scattering them into other
    blocks writes those blocks' bytes, each slot's position (row index x block size + offset)
    and a zero score, and nothing else. Under tensor parallelism a rank takes its own heads,
    the scheduler's ids translated to its pool."""
    from types import SimpleNamespace

    from pagedllm.kvcompress.shard import HeadShard
    from pagedllm.utils.pinned import PinnedRing
    from pagedllm.worker.head_rows import HeadRows

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layers, hr, bs, d, nb = 2, 2, 4, 8, 40  # hr: this rank's KV heads of a layer
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, nb, bs, d, generator=g).to(dtype).to(device)
    shard = HeadShard(rank, world, layers, hr)
    shard.num_blocks = nb
    cache = SimpleNamespace(kv=kv, shard=shard, num_layers=layers, num_kv_heads=hr,
                            block_size=bs, head_dim=d, dtype=dtype,
                            positions=torch.full((nb * bs,), -7, dtype=torch.int32, device=device),
                            scores=torch.full((nb * bs,), 5.0, device=device))  # fmt: skip
    rows_of = HeadRows(cache, PinnedRing(torch.device(device), 64))
    lh = layers * hr * world  # every rank's heads
    perm = np.random.default_rng(1).permutation(nb)
    # rows 3 and 4 of a prompt: the scheduler's ids of every rank's heads (rank r: + r * nb)
    heads = perm[: 2 * lh].reshape(2, lh) + rank * nb
    nbytes = layers * hr * 2 * bs * d * kv.element_size()
    rows = torch.zeros(2, nbytes, dtype=torch.uint8, device=device)
    rows_of.gather(heads, rows)
    mine = heads[:, shard.mine] - rank * nb  # [2, L * hr] this rank's blocks, local ids
    for i in range(2):
        for layer in range(layers):
            ids = torch.as_tensor(mine[i, layer * hr : (layer + 1) * hr], device=device)
            page = kv.view(torch.uint8)[:, ids].permute(0, 2, 1, 3)  # [2, bs, hr, d bytes]
            size = page.numel()
            got = rows[i, layer * size : (layer + 1) * size].view(page.shape)
            assert torch.equal(got, page)
    # into other blocks of a cache of zeros, as rows 3 and 4
    dst = perm[2 * lh : 4 * lh].reshape(2, lh) + rank * nb
    before = kv.clone()
    cache.kv = torch.zeros_like(kv)
    rows_of.scatter(rows, dst, np.array([3, 4]))
    local = dst[:, shard.mine] - rank * nb
    src_local = mine
    raw, ref = cache.kv.view(torch.uint8), before.view(torch.uint8)
    assert torch.equal(raw[:, torch.as_tensor(local.reshape(-1), device=device)],
                       ref[:, torch.as_tensor(src_local.reshape(-1), device=device)])  # fmt: skip
    touched = torch.zeros(nb, dtype=torch.bool)
    touched[torch.as_tensor(local.reshape(-1))] = True
    assert not raw[:, ~touched.to(device)].any()
    pos = cache.positions.view(nb, bs).cpu()
    for i, at in enumerate((3, 4)):
        for b in local[i]:
            assert pos[b].tolist() == list(range(at * bs, (at + 1) * bs))
    assert (pos[~touched] == -7).all()
    scores = cache.scores.view(nb, bs).cpu()
    assert (scores[touched] == 0).all() and (scores[~touched] == 5).all()
