"""``merge_sections``: how a stack or a benchmark lays its picker config over the defaults."""

from picker.stack.launcher import merge_sections


def test_a_section_of_both_is_merged_key_by_key_and_the_override_wins() -> None:
    base = {"queue": {"maxWait": "60s", "maxQueued": 10}, "scheduling": {"policy": "vtc"}}
    merged = merge_sections(base, {"queue": {"maxWait": "5s"}, "tenants": [{"id": "a"}]})
    assert merged == {"queue": {"maxWait": "5s", "maxQueued": 10},
                      "scheduling": {"policy": "vtc"}, "tenants": [{"id": "a"}]}
    assert base["queue"] == {"maxWait": "60s", "maxQueued": 10}  # the defaults are not changed


def test_a_section_that_is_not_a_mapping_replaces() -> None:
    assert merge_sections({"endpoints": [{"address": "a:1"}]},
                          {"endpoints": [{"address": "b:2"}]}) == {
        "endpoints": [{"address": "b:2"}]}
    assert merge_sections({"queue": {"maxWait": "1s"}}, {"queue": None}) == {"queue": None}
