"""Reading a vLLM ``/metrics`` page into the figures the capacity check uses."""

from __future__ import annotations

import pytest

from picker.scrape.scraper import EndpointFigures, parse_vllm_metrics

VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="27000",\
swap_space="4"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 98765.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4321.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.5
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",\
model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
""".replace("\\\n", "")


def test_realistic_vllm_page_gives_waiting_running_kv_usage_and_budget() -> None:
    figures = parse_vllm_metrics(VLLM_METRICS)
    assert figures == EndpointFigures(waiting=3.0, running=7.0, kv_usage=0.42,
                                      kv_budget_tokens=27000 * 16, prefix_caching=True)


@pytest.mark.parametrize(("label", "expected"), [
    ('enable_prefix_caching="False",', False), ('enable_prefix_caching="True",', True),
    ('enable_prefix_caching="false",', False), ('enable_prefix_caching="None",', None), ("", None)])
def test_whether_the_engine_caches_prefixes_is_read_from_its_cache_config(
        label: str, expected: bool | None) -> None:
    """``capacity.engineCache: auto`` reads vLLM's ``CacheConfig`` field as it exports it
    (Python's ``str`` of a bool); a page that does not say gives None."""
    text = f'vllm:cache_config_info{{block_size="16",{label}num_gpu_blocks="100"}} 1.0\n'
    figures = parse_vllm_metrics(text)
    assert figures.prefix_caching is expected and figures.kv_budget_tokens == 1600


def test_figures_are_summed_over_the_models_an_endpoint_serves() -> None:
    text = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 2.0
vllm:num_requests_waiting{model_name="base-lora"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 4.0
vllm:num_requests_running{model_name="base-lora"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="base"} 0.3
vllm:kv_cache_usage_perc{model_name="base-lora"} 0.7
"""
    figures = parse_vllm_metrics(text)
    assert figures.waiting == 3.0
    assert figures.running == 9.0
    assert figures.kv_usage == 0.7  # one cache: the highest report, not a sum


def test_absent_metrics_are_none() -> None:
    text = """\
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""
    assert parse_vllm_metrics(text) == EndpointFigures(None, None, None, None)
    assert parse_vllm_metrics("") == EndpointFigures(None, None, None, None)


def test_zero_is_a_reading_not_an_absence() -> None:
    text = ("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
            "vllm:kv_cache_usage_perc 0\n")
    assert parse_vllm_metrics(text) == EndpointFigures(0.0, 0.0, 0.0, None)


def test_older_gpu_cache_usage_perc_name_is_read() -> None:
    text = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""
    assert parse_vllm_metrics(text).kv_usage == 0.25


def test_cache_config_info_with_unknown_block_count_gives_no_budget() -> None:
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
            'vllm:num_requests_waiting 1\n')
    figures = parse_vllm_metrics(text)
    assert figures.kv_budget_tokens is None
    assert figures.waiting == 1.0


def test_cache_config_info_without_type_line_is_read() -> None:
    text = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="100"} 1.0\n'
    assert parse_vllm_metrics(text).kv_budget_tokens == 3200


def test_unparseable_page_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_waiting{model_name=\"m\" 3\n")


def test_only_the_wanted_families_are_parsed_and_lookalikes_are_not_taken() -> None:
    noise = "".join(
        f"# HELP vllm:request_latency_{i} x\n# TYPE vllm:request_latency_{i} histogram\n"
        + "".join(f'vllm:request_latency_{i}_bucket{{le="{b}",model_name="m"}} {b}\n'
                  for b in (1, 2, 5, 10))
        for i in range(50))
    page = (noise
            + "# HELP vllm:num_requests_waiting_by_reason lookalike\n"
            "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
            'vllm:num_requests_waiting_by_reason{reason="x"} 99.0\n'
            "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="a"} 2.0\n'
            'vllm:num_requests_waiting{model_name="b"} 1.0\n'
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n' + noise)
    figures = parse_vllm_metrics(page)
    assert (figures.waiting, figures.running, figures.kv_usage, figures.kv_budget_tokens) == \
        (3.0, 4.0, 0.25, 1600)
    assert parse_vllm_metrics(noise) == parse_vllm_metrics("")
