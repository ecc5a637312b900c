"""The isolation benchmarks' reading of the light tenant's TTFTs: bounds for requests that never
got a first token, and the steady state apart from the start-up."""
from bench.isolation import light_split


def test_a_request_without_a_first_token_counts_its_end_as_a_bound() -> None:
    light, never, _, _ = light_split([(0.0, 0.2, 1.0), (1.0, None, 5.0), (2.0, None, None)], 0.0)
    assert light == [0.2, 5.0]  # the one still open at the end is left out
    assert never == 1


def test_requests_before_the_cut_are_the_start_up_and_after_it_the_steady_state() -> None:
    rows = [(1.0, 3.0, 4.0), (9.99, 2.0, 2.5), (10.0, 0.1, 0.5), (30.0, None, 7.0)]
    light, _, steady, startup = light_split(iter(rows), 10.0)
    assert light == [3.0, 2.0, 0.1, 7.0]
    assert steady == [0.1, 7.0]
    assert startup == [3.0, 2.0]
