"""The dashboard's inline charts (core/views/sparkline.py): where the points go, the empty and
all-zero series, and a hostile label that must stay text."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from llmgw_cli.core.views.sparkline import HEIGHT, PAD, WIDTH, points, sparkline

SVG = "{http://www.w3.org/2000/svg}"


def parsed(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # well-formed XML, or this raises


def polyline(svg: str) -> list[tuple[float, float]]:
    line = parsed(svg).find(f"{SVG}polyline")
    assert line is not None
    return [(float(x), float(y)) for x, y in (p.split(",") for p in line.attrib["points"].split())]


def test_points_scale_to_the_box() -> None:
    got = points([0, 5, 10], width=100, height=20)
    assert got == [(0.0, 20 - PAD), (50.0, 10.0), (100.0, float(PAD))]  # zero on the baseline, max on top


def test_sixty_minutes_span_the_width_in_order() -> None:
    values = [float(i % 7) for i in range(60)]
    drawn = polyline(sparkline(values, "m"))
    assert len(drawn) == 60
    xs = [x for x, _ in drawn]
    assert xs[0] == 0 and xs[-1] == WIDTH and xs == sorted(xs)
    top = max(values)
    for (_, y), v in zip(drawn, values, strict=True):
        assert abs(y - (HEIGHT - PAD - v / top * (HEIGHT - 2 * PAD))) <= 0.05  # one decimal written


def test_the_title_says_the_largest_value() -> None:
    root = parsed(sparkline([1, 12, 3], "chat: requests per minute"))
    assert root.attrib["role"] == "img"
    assert (root.attrib["width"], root.attrib["height"]) == (str(WIDTH), str(HEIGHT))
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == "chat: requests per minute; max 12"
    assert root[0] is title  # first child: what assistive technology names the image by


def test_no_data_draws_only_the_baseline() -> None:
    svg = sparkline([], "chat")
    root = parsed(svg)
    assert root.find(f"{SVG}polyline") is None and root.find(f"{SVG}line") is not None
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == "chat; no data"
    assert points([]) == []


def test_all_zeros_lie_on_the_baseline() -> None:
    drawn = polyline(sparkline([0] * 60, "idle"))
    assert {y for _, y in drawn} == {HEIGHT - PAD}
    title = parsed(sparkline([0] * 60, "idle")).find(f"{SVG}title")
    assert title is not None and title.text == "idle; max 0"


def test_one_value_and_values_that_are_not_counts() -> None:
    assert points([3]) == [(WIDTH / 2, float(PAD))]
    drawn = polyline(sparkline([float("nan"), float("inf"), -4, 2], "odd"))
    assert [y for _, y in drawn] == [HEIGHT - PAD] * 3 + [float(PAD)]


def test_a_hostile_label_stays_text() -> None:
    label = '<script>alert(1)</script>" onload="x'
    svg = sparkline([1, 2], label)
    assert "<script" not in svg and 'onload="' not in svg
    root = parsed(svg)
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == f"{label}; max 2"
    assert {child.tag for child in root} == {f"{SVG}{t}" for t in ("title", "line", "polygon", "polyline")}
    assert all(
        set(el.attrib)
        <= {
            "x1",
            "y1",
            "x2",
            "y2",
            "points",
            "fill",
            "fill-opacity",
            "stroke",
            "stroke-width",
            "stroke-linejoin",
        }
        for el in root
        if el.tag != f"{SVG}title"
    )
