"""Report rendering: ticks, SVG charts (no data, log axis, bad points), tables, escaping.

    pytest tests/test_reports_render.py
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from andrea.reports import render as R


def test_nice_ticks_are_round_and_cover_the_range():
    assert [round(v, 9) for v in R.nice_ticks(0, 1, 5)] == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    t = R.nice_ticks(3.2, 5.7, 5)
    assert t[0] >= 3.2 and t[-1] <= 5.7 and len(t) >= 3
    steps = {round(b - a, 9) for a, b in zip(t, t[1:])}
    assert len(steps) == 1 and steps.pop() in (0.5, 1.0, 0.2)
    assert R.nice_ticks(float("nan"), 1) == []
    assert R.nice_ticks(2, 2)                                   # degenerate range still gets ticks


def test_line_chart_is_valid_svg_and_drops_bad_points():
    svg = R.line_chart({"a": [(0, 1.0), (1, float("nan")), (2, 3.0)], "b<&>": [(0, 2.0)]},
                       title="t & t", xlabel="step", ylabel="loss")
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 1 and len(lines[0].get("points").split()) == 2
    assert any(e.tag.endswith("circle") for e in root.iter())    # the lone point of "b<&>"
    assert "b&lt;&amp;&gt;" in svg and "t &amp; t" in svg


def test_empty_and_log_charts():
    assert "no data" in R.line_chart({"a": []}, title="x", xlabel="s", ylabel="y")
    svg = R.line_chart({"a": [(0, 1e-4), (1, 1e-2), (2, -1.0)]}, title="lr", xlabel="s", ylabel="y", log_y=True)
    ET.fromstring(svg)
    assert "1e-04" in svg or "1e-4" in svg
    assert "no data" in R.bar_chart({"a": None}, title="b", ylabel="y")
    ET.fromstring(R.bar_chart({"x": 1.5, "y": float("inf"), "z": 0.2}, title="b", ylabel="y"))


def test_tables_and_fmt():
    assert R.fmt(None) == "-" and R.fmt(float("nan")) == "-" and R.fmt(True) == "yes"
    assert R.fmt(3) == "3" and R.fmt(2.5) == "2.5000" and R.fmt(1234.5) == "1234.5" and R.fmt(1e-5) == "1.000e-05"
    md = R.md_table(["a|b", "c"], [["x|y", 1.0]])
    assert md.splitlines()[0] == "| a\\|b | c |" and "x\\|y" in md
    html = R.html_table(["h"], [["<b>"], [2.0]])
    assert "&lt;b&gt;" in html and 'class="num"' in html
    page = R.html_page("T", [("S", "<p>x</p>")], subtitle="sub")
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page and "<h2>S</h2>" in page
    assert math.isfinite(float(R.fmt(0.5)))


def test_pinned_colours_follow_the_name():
    cmap = R.colour_map(["py-code", "chat-single", "py-code"])
    assert cmap == {"chat-single": R.PALETTE[0], "py-code": R.PALETTE[1]}
    svg = R.line_chart({"py-code": [(0, 1), (1, 2)], "new": [(0, 2), (1, 1)]}, title="t", xlabel="x", ylabel="y",
                       colours=cmap)
    assert f'stroke="{R.PALETTE[1]}"' in svg and f'stroke="{R.PALETTE[1]}" stroke-width' in svg
    assert 'fill="#123456"' in R.bar_chart({"a": 1.0}, title="b", ylabel="y", colours={"a": "#123456"})
