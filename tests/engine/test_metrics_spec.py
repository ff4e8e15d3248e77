"""The server's speculative-decoding metrics (pagedllm/metrics.py): absent without speculation,
and under vLLM's names with every series valued once the engine reports them."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest  # noqa: E402

from pagedllm.metrics import ServerMetrics  # noqa: E402


def _text(m: ServerMetrics) -> str:
    return generate_latest(m.registry).decode()


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exported:\n{text}")


def test_absent_without_speculation_and_counted_with_it() -> None:
    m = ServerMetrics("tiny")
    m.record({"num_running_reqs": 1}, [])
    assert "spec_decode" not in _text(m)
    stats = {
        "spec_decode_num_drafts": 3,
        "spec_decode_num_draft_tokens": 10,
        "spec_decode_num_accepted_tokens": 4,
        "spec_decode_num_accepted_tokens_per_pos": [3, 1, 0, 0],
    }
    m.record(stats, [])
    m.record({**stats, "spec_decode_num_drafts": 5}, [])  # cumulative: only the growth counts
    text = _text(m)
    label = 'model_name="tiny"'
    assert _value(text, f"vllm:spec_decode_num_drafts_total{{{label}}}") == 5
    assert _value(text, f"vllm:spec_decode_num_draft_tokens_total{{{label}}}") == 10
    assert _value(text, f"vllm:spec_decode_num_accepted_tokens_total{{{label}}}") == 4
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert _value(text, f'{per_pos}{{{label},position="0"}}') == 3
    assert _value(text, f'{per_pos}{{{label},position="1"}}') == 1
    assert _value(text, f'{per_pos}{{{label},position="3"}}') == 0  # valued, not only HELP
