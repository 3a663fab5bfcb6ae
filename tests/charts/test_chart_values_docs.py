"""values.yaml documents every value in a comment that starts with the value's name."""

from __future__ import annotations

import re

from tests.charts.chart_support import CHART

KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z][A-Za-z0-9]*):")


def test_every_value_has_a_comment_starting_with_its_name():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    num_keys = 0
    for number, line in enumerate(lines):
        match = KEY_LINE.match(line)
        if not match:
            continue
        num_keys += 1
        indent, key = match["indent"], match["key"]
        # The comment block right above the key, at the key's indentation.
        above = number - 1
        while above >= 0 and lines[above].startswith(f"{indent}# ") and above - 1 >= 0:
            if not lines[above - 1].startswith(f"{indent}# "):
                break
            above -= 1
        first = lines[above] if above >= 0 else ""
        if not first.startswith(f"{indent}# {key}:"):
            undocumented.append(f"line {number + 1}: {key}")
    assert num_keys > 50
    assert not undocumented, "values without a '# <name>: ...' comment: " + ", ".join(undocumented)
