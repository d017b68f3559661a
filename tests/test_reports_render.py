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


RECIPE = ["chat-system", "chat-single", "chat-multi", "py-topics", "py-moddocs", "py-apidocs", "py-notes", "py-code"]


def _drawn_looks(svg: str) -> dict[str, tuple[str, str]]:
    """Each polyline's (stroke, dash) by its series name."""
    return {e.get("data-series"): (e.get("stroke"), e.get("stroke-dasharray") or "")
            for e in ET.fromstring(svg).iter() if e.tag.endswith("polyline")}


def test_source_looks_follow_the_config_order_and_never_repeat():
    looks = R.source_styles(RECIPE)
    assert [looks[s] for s in RECIPE] == [R.style_at(i) for i in range(8)]       # the config's order, not sorted
    assert looks["chat-system"] == (R.HUES[0], "") and looks["py-code"] == (R.HUES[7], "")
    for n in (8, 20, 40):
        names = [f"src-{i:02d}" for i in range(n)]
        got = R.source_styles(names)
        assert len({got[s] for s in names}) == n, n                                  # injective
        assert not {got[s] for s in names} & set(R.FIXED.values())                   # never an aggregate's look
    assert len({R.source_styles([f"s{i}" for i in range(20)])[f"s{i}"][0] for i in range(20)}) == 10  # hue + dash
    # a name seen in a history but not in the config comes after the config's, sorted; the config's keep theirs
    more = R.source_styles(RECIPE, seen=["zz-new", "aa-new", "py-code"])
    assert all(more[s] == looks[s] for s in RECIPE)
    assert more["aa-new"] == R.style_at(8) and more["zz-new"] == R.style_at(9)
    assert R.config_sources({"megachat": {"sources": [{"name": n} for n in RECIPE]}}) == RECIPE
    assert R.config_sources({}) == [] and R.config_sources(None) == []


def test_charts_draw_each_source_in_its_look_and_no_two_series_alike():
    looks = R.source_styles(RECIPE)
    series = {s: [(0, 1.0 + i), (1, 2.0 + i)] for i, s in enumerate(reversed(RECIPE))}
    drawn = _drawn_looks(R.line_chart({"overall": [(0, 1), (1, 2)], **series}, title="t", xlabel="x", ylabel="y",
                                      styles=looks))
    assert drawn == {n: looks[n] for n in ["overall", *RECIPE]}
    # unpinned series take looks no pinned series of the chart has
    drawn = _drawn_looks(R.line_chart({"py-code": [(0, 1), (1, 2)], "new": [(0, 2), (1, 1)], "other": [(0, 3), (1, 1)]},
                                      title="t", xlabel="x", ylabel="y", styles={"py-code": R.style_at(0)}))
    assert drawn["py-code"] == R.style_at(0) and len(set(drawn.values())) == 3
    many = {f"s{i}": [(0, i), (1, i + 1)] for i in range(20)}
    drawn = _drawn_looks(R.line_chart(many, title="t", xlabel="x", ylabel="y", styles=R.source_styles(many)))
    assert len(set(drawn.values())) == 20 and drawn["s12"][1] == R.DASHES[1]
    assert 'stroke-dasharray="6 3"' in R.line_chart(many, title="t", xlabel="x", ylabel="y")  # the legend shows the dash
    bars = ET.fromstring(R.bar_chart({"a": 1.0, "b": 2.0}, title="b", ylabel="y",
                                     styles={"a": ("#123456", ""), "b": ("#123456", "2 2")}))
    rects = {e.find("{http://www.w3.org/2000/svg}title").text.split(":")[0]: e for e in bars.iter()
             if e.tag.endswith("rect") and e.find("{http://www.w3.org/2000/svg}title") is not None}
    assert rects["a"].get("fill") == "#123456" and rects["a"].get("stroke-dasharray") is None
    assert rects["b"].get("stroke-dasharray") == "2 2" and rects["b"].get("fill-opacity") == "0.45"
