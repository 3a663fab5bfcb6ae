"""The emulator's pure helpers: RFC 7386 merge patches and label selectors."""

from __future__ import annotations

from typing import Any

import pytest

from .meta import merge_patch, selector_matches


# RFC 7386, appendix A: target, patch, result.
@pytest.mark.parametrize(
    ("target", "patch", "result"),
    [
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"a": "b"}, ["c"], ["c"]),
        ({"a": "foo"}, None, None),
        ({"a": "foo"}, "bar", "bar"),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_follows_rfc_7386(target: Any, patch: Any, result: Any):
    assert merge_patch(target, patch) == result


def test_merge_patch_modifies_neither_input():
    target = {"a": {"b": 1, "c": [1]}}
    patch = {"a": {"b": None, "d": {"e": 1}}}
    merged = merge_patch(target, patch)
    merged["a"]["d"]["e"] = 2
    assert target == {"a": {"b": 1, "c": [1]}} and patch == {"a": {"b": None, "d": {"e": 1}}}


@pytest.mark.parametrize(
    ("selector", "selected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app=db", False),
        ("app!=db", True),
        ("missing!=x", True),
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app=web, tier", True),
        ("app=web,tier=back", False),
    ],
)
def test_label_selectors(selector: str, selected: bool):
    assert selector_matches(selector, {"app": "web", "tier": "front"}) is selected
