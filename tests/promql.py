"""The metric names a PromQL expression reads, for the tests of generated dashboards.

Enough of PromQL for the expressions llmgw writes: strings, label matchers, ranges and
the label lists of ``by``/``on``/... are dropped, then every name not called as a
function and not a keyword is a metric name.
"""

from __future__ import annotations

import re

KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"^label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*[A-Za-z_]\w*\s*\)$")


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_LIST.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group()
        if word in KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        if match.start() and text[match.start() - 1].isdigit():
            continue  # the exponent or unit of a number (1e3)
        names.add(word)
    return names


def label_values_metric(query: str) -> str:
    """The metric of a Grafana variable's ``label_values(metric, label)``."""
    match = _LABEL_VALUES.match(query.strip())
    assert match, f"not label_values(metric, label): {query!r}"
    return match.group(1)
