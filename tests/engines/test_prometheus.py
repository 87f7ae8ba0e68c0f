"""vLLM's spec-decode counters read from a /metrics text by prometheus_client: names without the
`vllm:spec_decode_` prefix and `_total` suffix, per-position counts keyed `.posN`, values summed
over the other labels, non-counter lines and other metrics ignored."""

from dflash_plugin.engines.vllm_server import parse_spec_metrics

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 42.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_parse_spec_metrics_table():
    assert parse_spec_metrics(METRICS) == {
        "num_drafts": 15.0,
        "num_accepted_tokens": 42.0,
        "num_accepted_tokens_per_pos.pos0": 9.0,
        "num_accepted_tokens_per_pos.pos1": 7.0,
    }


def test_no_spec_metrics():
    assert parse_spec_metrics("") == {}
