"""Decode context parallelism on the CPU (issue 56): ``decode_context_parallel_size`` 2 and 4
over gloo give the greedy tokens of one rank on every architecture (sliding windows
included), with chunked prefill, prefix hits, preemption and speculative decoding; the same
KV memory holds D times the tokens; settings it cannot serve are refused with the field
named.

The models have fewer KV heads than ranks (that is where DCP applies: tensor parallelism would
copy each KV head onto tp / num_kv_heads ranks). fp32 tiny random models, as the tensor-
parallel tests: the merged attention adds the ranks' shares in another order than one
softmax, and the peaky tiny models' greedy tokens agree exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from tests.models.tiny import make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n: int = 5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(rng.integers(8, 40))).tolist()}
               for _ in range(n)]  # fmt: skip
    # a prefix hit: the first prompt again, longer
    return prompts + [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7]}]


def _engine(path: str, tp: int, dcp: int, **kw: object) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=tp,
               decode_context_parallel_size=dcp, **kw)  # fmt: skip


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """arch -> a tiny model of that architecture with one KV head."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(
                arch, str(tmp_path_factory.mktemp(arch)), num_key_value_heads=1
            )
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_dcp2_equals_one_rank_every_arch(one_kv_head, arch: str) -> None:
    """Two ranks share the one KV head's tokens (each stores every other position), with a
    16-token budget (prompts in chunks) and a prefix hit."""
    path = one_kv_head(arch)
    prompts = _prompts()
    kw = {"max_num_batched_tokens": 16}
    want = _tokens(_engine(path, 1, 1, **kw), prompts)
    llm = _engine(path, 2, 2, **kw)
    assert _tokens(llm, prompts) == want
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_size == 32


@pytest.mark.parametrize(("kv_heads", "tp", "dcp"), [(1, 4, 4), (2, 4, 2)], ids=["dcp4", "2x2"])
def test_dcp4_and_two_groups(tmp_path, kv_heads: int, tp: int, dcp: int) -> None:
    """One KV head over 4 ranks, each a quarter of the tokens; two KV heads over 4 ranks,
    two groups of two (ranks 0-1 share KV head 0, ranks 2-3 KV head 1)."""
    path = make_tiny_model("qwen3", str(tmp_path / "m"), num_key_value_heads=kv_heads)
    prompts = _prompts(4, seed=1)
    want = _tokens(_engine(path, 1, 1, max_num_batched_tokens=16), prompts)
    assert _tokens(_engine(path, tp, dcp, max_num_batched_tokens=16), prompts) == want


def test_capacity_grows_and_long_requests_fit(one_kv_head) -> None:
    """At equal KV memory DCP 2 holds twice the tokens: 6 blocks of 16 tokens (96) cannot
    hold a 120-token request, 6 blocks of 32 (192) can; with more requests than fit at once,
    preemption and recompute keep the tokens of one rank."""
    path = one_kv_head("llama")
    tp2 = _engine(path, 2, 1, num_gpu_blocks_override=6)
    dcp2 = _engine(path, 2, 2, num_gpu_blocks_override=6, max_num_batched_tokens=16)
    capacity = [
        (m.num_blocks, m.block_size)
        for m in (x.llm_engine.engine_core.scheduler.kv_cache_manager for x in (tp2, dcp2))
    ]
    assert capacity == [(6, 16), (6, 32)]
    long = [{"prompt_token_ids": list(range(3, 103))}]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with pytest.raises(ValueError, match="KV cache"):
        tp2.generate(long, sp, use_tqdm=False)
    one = _engine(path, 1, 1)
    assert _tokens(dcp2, long, sp) == _tokens(one, long, sp)
    prompts = _prompts(6, seed=3)  # 7 requests of 8-40 tokens + 24 each: more than 192
    assert _tokens(dcp2, prompts) == _tokens(one, prompts)
    assert dcp2.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_speculative_decoding_rows(one_kv_head) -> None:
    """n-gram drafts: verification rows of several tokens, attended over the split keys."""
    path = one_kv_head("qwen2")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    prompts = [{"prompt_token_ids": [7, 8, 9, 10] * 6 + [11]}, *_prompts(2, seed=4)]
    want = _tokens(_engine(path, 1, 1), prompts)
    assert _tokens(_engine(path, 2, 2, speculative_config=spec), prompts) == want


def test_fp8_cache_and_forked_sequences(one_kv_head) -> None:
    """An fp8 cache (each rank quantizes its own positions with the shared scales) and n = 2
    seeded samples (forked blocks copied on each rank) give one rank's tokens."""
    path = one_kv_head("qwen3")
    prompts = _prompts(3, seed=5)
    params = [GREEDY, SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=16)]
    outs = []
    for tp, dcp in ((1, 1), (2, 2)):
        llm = _engine(path, tp, dcp, kv_cache_dtype="fp8", max_num_batched_tokens=16)
        got = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)
        outs.append([[list(c.token_ids) for c in o.outputs] for o in got])
    assert outs[0] == outs[1]
    assert len(outs[1][1]) == 2


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
         r"must divide tensor_parallel_size / num_kv_heads \(2 / 2\)"),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 4},
         r"decode_context_parallel_size \(4\) must"),
        ({"tensor_parallel_size": 1, "decode_context_parallel_size": 0},
         "decode_context_parallel_size"),
    ],
    ids=["kv-heads-not-copied", "more-than-tp", "zero"],
)  # fmt: skip
def test_refused_shapes(tiny_models, kw: dict, match: str) -> None:
    """The tiny llama has 2 KV heads: at tp 2 each rank holds its own, nothing to split."""
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_models("llama"), device="cpu", **kw).create_engine_config()


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"kv_connectors": ("a_probe",)}, "kv_connectors"),
        ({"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": 2}},
         "ngram_gpu"),
    ],
)  # fmt: skip
def test_refused_combinations(one_kv_head, extra: dict, name: str) -> None:
    args = EngineArgs(model=one_kv_head("llama"), device="cpu", tensor_parallel_size=2,
                      decode_context_parallel_size=2, **extra)  # fmt: skip
    with pytest.raises(ValueError, match=f"decode_context_parallel_size > 1 .*{name}"):
        args.create_engine_config()


def test_the_host_tier_and_kv_transfers_move_each_ranks_share(one_kv_head, tmp_path) -> None:
    """DCP = 2 with the host KV tier and with prefill/decode disaggregation: each rank saves,
    writes and loads its own share of every block (the scheduler's blocks span D x block_size
    positions: 32 here). A prompt pushed out of a 12-block device pool comes back from the
    tier with the cold run's tokens and logprobs; a DCP pair's tokens are one rank's, each
    rank reading its own file."""
    from tests.engine.test_kv_transfer import _decode, _hand_over, _role

    path = one_kv_head("llama")
    rng = np.random.default_rng(3)
    a, *others = (rng.integers(3, 500, 150).tolist() for _ in range(5))
    one = _tokens(_engine(path, 1, 1), [{"prompt_token_ids": a}])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        c = out.outputs[0]
        return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]

    llm = _engine(path, 2, 2, kv_offloading_size=0.01, num_gpu_blocks_override=12,
                  max_num_seqs=1)  # fmt: skip
    try:
        cold = run(llm, a)
        for p in others:
            run(llm, p)
        again = run(llm, a)
        tier = next(c for c in llm.llm_engine.engine_core.scheduler.connectors
                    if c.name == "offload")  # fmt: skip
        assert tier.hit_tokens == (150 - 1) // 32 * 32
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert again[0] == cold[0] == one[0][:8]
    np.testing.assert_allclose(again[1], cold[1], rtol=1e-5, atol=1e-5)
    # one engine in both roles (no prefix cache: the consumer side reads the whole transfer)
    both = _engine(path, 2, 2, max_num_batched_tokens=32, enable_prefix_caching=False,
                   kv_transfer_config={"kv_role": "kv_both", "kv_buffer_path": str(tmp_path),
                                       "engine_id": "both"})  # fmt: skip
    try:
        (params,) = _hand_over(both, [a])
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            params["remote_block_file"] + f".r{r}" for r in range(2)
        ]
        (got,) = both.generate([{"prompt_token_ids": a}], _decode(params, 24), use_tqdm=False)
        assert _role(both).received_tokens == (150 - 1) // 32 * 32
    finally:
        both.llm_engine.engine_core.shutdown()
    assert list(got.outputs[0].token_ids) == one[0]


def test_cli_flag() -> None:
    from pagedllm.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "4", "-dcp", "2"])
    assert ns.decode_context_parallel_size == 2
