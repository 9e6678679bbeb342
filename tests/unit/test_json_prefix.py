"""The JSON-prefix check the conformance runner uses for grammar-bound replies
cut off at max_tokens."""

from __future__ import annotations

import pytest

from jetserve.conformance.json_prefix import is_json_prefix


@pytest.mark.parametrize(
    "text",
    [
        '{"city": "Paris", "temp_c": 21.5}',
        '{"city": "Par',
        '{"city": "Paris", "te',
        '{"city": "Paris", "temp_c": 2',
        '{"city": "Paris", "temp_c": -',
        '{"ok": tr',
        '{"list": [1, 2, {"a": null',
        '{"esc": "a \\" quote',
        "{",
        "  {\n",
        '{"city": "Paris",',
        '{"a": 1}  ',
    ],
)
def test_the_start_of_json_is_a_prefix(text: str) -> None:
    assert is_json_prefix(text)


@pytest.mark.parametrize(
    "text",
    [
        "Sure! Here is the weather in Paris.",
        '{"city" "Paris"}',
        '{"city": Paris',
        '{"a": 1}}',
        '{"a": 1} trailing',
        '{"a": tx',
        '{"a": 01',
        "{,",
        '{"a": 1,,',
        "[1, 2}",
    ],
)
def test_text_that_no_continuation_makes_json_is_not(text: str) -> None:
    assert not is_json_prefix(text)
