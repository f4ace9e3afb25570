"""Reading a worker's /metrics: vLLM's queue, KV-cache use and KV-cache size, from real
vLLM text and from odd text, which never raises."""

from __future__ import annotations

import random

import pytest

from routing.hop.scrape import MAX_TOKENS, Reading, gauge, props_tokens, read

# As vLLM (v1) writes it, abridged: one info sample with the cache's shape in labels.
VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.42
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27182",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-0.6B"} 7.0
"""


def test_a_vllm_page_is_read() -> None:
    assert read(VLLM, load=True, cache=True) == Reading(3.0, 0.42, 27182 * 16)


def test_only_what_is_asked_for_is_read() -> None:
    assert read(VLLM, load=False, cache=True) == Reading(None, None, 27182 * 16)
    assert read(VLLM, load=True, cache=False) == Reading(3.0, 0.42, None)


def test_a_gauge_that_is_not_there_is_none_not_zero() -> None:
    assert read("vllm:num_requests_waiting 2\n", load=True, cache=True) == Reading(2.0)
    assert read("", load=True, cache=True) == Reading()


def test_the_old_kv_gauge_name_is_read() -> None:
    assert read("vllm:gpu_cache_usage_perc 0.5\n", load=True, cache=False).kv_usage == 0.5


def test_the_engines_of_a_data_parallel_worker_add_up() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1.0\n'
        # An engine told twice counts once (the last).
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="60"} 1.0\n'
    )
    assert read(text, load=False, cache=True).kv_tokens == 16 * 160


@pytest.mark.parametrize(
    "labels",
    [
        'block_size="16",num_gpu_blocks="None"',  # before vLLM measured its memory
        'block_size="16"',
        'block_size="0",num_gpu_blocks="10"',
        'block_size="-16",num_gpu_blocks="10"',
        'block_size="16",num_gpu_blocks="1e3"',
        'block_size="16",num_gpu_blocks="١٢"',  # digits, but not ASCII ones
        'block_size="16",num_gpu_blocks="9999999999999999999999"',
    ],
)
def test_a_cache_shape_that_does_not_parse_is_no_size(labels: str) -> None:
    text = f"vllm:cache_config_info{{{labels}}} 1.0\n"
    assert read(text, load=False, cache=True).kv_tokens is None


def test_a_shape_whose_info_value_is_zero_is_not_in_force() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="10"} 0.0\n'
    assert read(text, load=False, cache=True).kv_tokens is None


def test_a_huge_cache_is_held_to_the_configs_bound() -> None:
    text = 'vllm:cache_config_info{block_size="999999",num_gpu_blocks="999999999"} 1\n'
    assert read(text, load=False, cache=True).kv_tokens == MAX_TOKENS


def test_labels_with_braces_spaces_and_escapes_inside_quotes() -> None:
    text = (
        'vllm:cache_config_info{x="a } b",y="say \\"hi\\" {",block_size="8",'
        'num_gpu_blocks="4"} 1 1700000000000\n'
        'vllm:num_requests_waiting{model_name="a b} c"} 2 1700000000000\n'
    )
    assert read(text, load=True, cache=True) == Reading(2.0, None, 32)


@pytest.mark.parametrize(
    "line",
    [
        "vllm:num_requests_waiting{",
        'vllm:num_requests_waiting{model_name="a} 4',  # the quote never closes
        "vllm:num_requests_waiting x",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting NaN",
        "vllm:num_requests_waiting +Inf",
        "vllm:num_requests_waiting 1e999",
        "vllm:num_requests_waitingx 5",  # another name that starts alike
    ],
)
def test_a_line_that_does_not_parse_is_skipped(line: str) -> None:
    text = f"{line}\nvllm:num_requests_waiting 2\n"
    assert gauge(text, ("vllm:num_requests_waiting",)) == 2.0


def test_a_sum_past_a_float_is_no_value() -> None:
    text = "vllm:num_requests_waiting 1e308\n" * 2 + "vllm:kv_cache_usage_perc -1e308\n" * 2
    assert read(text, load=True, cache=False) == Reading()


def test_random_text_never_raises() -> None:
    pieces = [
        "vllm:cache_config_info", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "{",
        "}", '"', "\\", "=", ",", " ", "\t", "\n", "block_size", "num_gpu_blocks", "engine",
        '="16"', '="None"', "1", "-1", "1e308", "nan", "0x10", "\x00", "\u2028", "é",
    ]  # fmt: skip
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        reading = read(text, load=True, cache=True)
        assert reading.kv_tokens is None or 0 < reading.kv_tokens <= MAX_TOKENS


# As llama.cpp's llama-server writes them (`--metrics`, and /props abridged).
LLAMA = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""
PROPS = '{"default_generation_settings": {"n_ctx": 4096, "params": {}}, "total_slots": 4}'


def test_llama_cpp_its_queue_from_metrics_its_cache_from_props() -> None:
    reading = read(LLAMA, load=True, cache=True, props=PROPS)
    assert (reading.waiting, reading.kv_usage, reading.kv_tokens) == (3.0, None, 4096 * 4)
    assert read(LLAMA, load=True, cache=True).kv_tokens is None  # /props not read: unknown
    # vLLM's own size wins over any /props.
    assert read(VLLM, load=False, cache=True, props=PROPS).kv_tokens == 27182 * 16


@pytest.mark.parametrize(
    "props",
    ["", "[]", "{}", '{"default_generation_settings": 1, "total_slots": 2}',
     '{"default_generation_settings": {"n_ctx": 0}, "total_slots": 2}',
     '{"default_generation_settings": {"n_ctx": true}, "total_slots": 2}',
     '{"default_generation_settings": {"n_ctx": 4096}, "total_slots": "2"}'],
)  # fmt: skip
def test_props_that_do_not_say_give_no_size(props: str) -> None:
    assert props_tokens(props) is None


def test_props_size_is_bounded() -> None:
    huge = '{"default_generation_settings": {"n_ctx": 1000000000}, "total_slots": 1000}'
    assert props_tokens(huge) == MAX_TOKENS
