"""Self-contained report rendering: inline SVG charts, HTML pages and Markdown tables.

Nothing here reaches the network: every figure is an inline ``<svg>`` element and
the page carries its own CSS, so ``eval.html`` opens from disk anywhere. Output is a
pure function of the input (fixed looks per source, fixed number formatting), so the same
run gives byte-identical reports.

    from andrea.reports import render
    svg = render.line_chart({"train": [(0, 5.1), (10, 4.2)]}, title="loss", xlabel="step", ylabel="nats")
    looks = render.source_styles(render.config_sources(cfg))    # pass as styles= to every chart
    page = render.html_page("ANDREA tiny", [("Loss", svg)])
    md = render.md_table(["source", "bpb"], [["py-code", 1.234]])
"""

from __future__ import annotations

import html
import math
from typing import Iterable, Sequence

# One look per source in every chart (eval.html, the live dashboard, DVC's plots page): the
# sources in the config's order (megachat.sources) take HUES in turn (Okabe-Ito without black,
# then distinct extras); past the tenth the hues come round again with the next dash pattern, so
# up to len(HUES) x len(DASHES) = 40 series never share a look. Black and grey are kept for the
# aggregates (FIXED), so no source is ever drawn like "overall" or the unigram baseline.
HUES = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#8C564B", "#882255",
        "#BCBD22", "#F0E442")
DASHES = ("", "6 3", "2 2", "10 3 2 3")
FIXED = {"overall": ("#000000", ""), "unigram": ("#7F7F7F", "4 3")}
LOSS_LOOKS = {"train loss": ("#B0B0B0", ""), "smma": ("#000000", "")}   # the (source-free) train-loss chart
Style = tuple  # (colour, SVG stroke-dasharray; "" = solid)


def style_at(i: int) -> Style:
    """The i-th look: hue i mod 10, dash pattern i div 10 (cycling past 40)."""
    return HUES[i % len(HUES)], DASHES[(i // len(HUES)) % len(DASHES)]


def source_styles(sources: Iterable[str], seen: Iterable[str] = ()) -> dict[str, Style]:
    """The one source -> (colour, dash) mapping: ``sources`` (the config's order) first, then any
    other name ``seen`` in a history (sorted), then FIXED for the aggregates."""
    order = [s for s in dict.fromkeys(sources) if s not in FIXED]
    order += sorted(set(seen) - set(order) - set(FIXED))
    return {**{s: style_at(i) for i, s in enumerate(order)}, **FIXED}


def config_sources(cfg: dict | None) -> list[str]:
    """The source names of a config, in its order (``megachat.sources[].name``); [] without them."""
    srcs = ((cfg or {}).get("megachat") or {}).get("sources") or []
    return [str(s["name"]) for s in srcs if isinstance(s, dict) and s.get("name") is not None]


def _looks(names: Sequence[str], styles: dict[str, Style] | None) -> dict[str, Style]:
    """Each name's look in one chart: its pinned style, else the first look no other series of
    this chart has, so no two series of a chart ever look the same."""
    styles = styles or {}
    used = {tuple(styles[n]) for n in names if n in styles}
    out, k = {}, 0
    for n in names:
        if n in styles:
            out[n] = tuple(styles[n])
            continue
        while style_at(k) in used:
            k += 1
        out[n] = style_at(k)
        used.add(out[n])
    return out


def _dash(d: str) -> str:
    return f' stroke-dasharray="{d}"' if d else ""


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1000px;color:#222;padding:0 1em}
h1{font-size:1.6em;border-bottom:2px solid #0072B2;padding-bottom:.2em}
h2{font-size:1.25em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f2f5f8}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:.6em;white-space:pre-wrap;word-break:break-word;font-size:.88em}
.flag{color:#B00020;font-weight:600}
.note{color:#555;font-style:italic}
figure{margin:1em 0}
svg text{font-family:system-ui,sans-serif}
""".strip()


def esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def fmt(v: object, digits: int = 4) -> str:
    """A number as short fixed text (``None``/NaN -> ``-``); anything else via ``str``."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.{max(digits - 1, 1)}e}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}f}"
    return str(v)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 x 10^k)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        if t >= lo - step * 1e-9:
            ticks.append(round(t, 12))
        t += step
    return ticks


def _tick_label(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.0e}"
    if a >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.6g}"


def line_chart(series: dict[str, Sequence[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str,
               width: int = 680, height: int = 300, log_y: bool = False, y_min: float | None = None,
               y_max: float | None = None, styles: dict[str, Style] | None = None) -> str:
    """An inline SVG line chart: one polyline per named series of (x, y) points, with axes and a legend.

    ``styles`` pins a series' (colour, dash) by name (``source_styles``: one source looks the
    same in every figure); others take the first look unused in this chart. Non-finite points
    are dropped (and, with
    ``log_y``, non-positive ones). A chart with
    no points says so in place of lines, so a report never silently shows an empty box.
    """
    clean: dict[str, list[tuple[float, float]]] = {}
    for name, pts in series.items():
        keep = [(float(x), float(y)) for x, y in pts
                if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
                and (not log_y or float(y) > 0)]
        if keep:
            clean[name] = keep
    ml, mr, mt, mb = 62, 14, 30, 44
    legend_rows = (len(clean) + 3) // 4
    height_total = height + 18 * legend_rows
    pw, ph = width - ml - mr, height - mt - mb
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height_total}" '
             f'viewBox="0 0 {width} {height_total}" role="img" aria-label="{esc(title)}">',
             f'<rect x="0" y="0" width="{width}" height="{height_total}" fill="#fff"/>',
             f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" font-weight="600">{esc(title)}</text>']
    if not clean:
        parts.append(f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" font-size="13" '
                     f'fill="#888">no data</text></svg>')
        return "".join(parts)
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    ty = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    y0 = ty(y_min) if y_min is not None else min(map(ty, ys))
    y1 = ty(y_max) if y_max is not None else max(map(ty, ys))
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return mt + ph - (ty(y) - y0) / (y1 - y0) * ph

    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in nice_ticks(x0, x1, 6):
        X = px(t)
        parts.append(f'<line x1="{X:.1f}" y1="{mt}" x2="{X:.1f}" y2="{mt + ph}" stroke="#eee"/>'
                     f'<text x="{X:.1f}" y="{mt + ph + 15}" text-anchor="middle" font-size="11">{_tick_label(t)}</text>')
    yt = ([10 ** e for e in range(math.floor(y0), math.ceil(y1) + 1)] if log_y and y1 - y0 >= 1
          else ([10 ** t for t in nice_ticks(y0, y1, 5)] if log_y else nice_ticks(y0, y1, 5)))
    for t in yt:
        if not (y0 <= ty(t) <= y1):
            continue
        Y = py(t)
        parts.append(f'<line x1="{ml}" y1="{Y:.1f}" x2="{ml + pw}" y2="{Y:.1f}" stroke="#eee"/>'
                     f'<text x="{ml - 6}" y="{Y + 4:.1f}" text-anchor="end" font-size="11">{_tick_label(t)}</text>')
    parts.append(f'<text x="{ml + pw / 2:.1f}" y="{mt + ph + 34}" text-anchor="middle" font-size="12">{esc(xlabel)}</text>'
                 f'<text x="14" y="{mt + ph / 2:.1f}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {mt + ph / 2:.1f})">{esc(ylabel)}</text>')
    looks = _looks(list(clean), styles)
    for i, (name, pts) in enumerate(clean.items()):
        colour, dash = looks[name]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        if len(pts) == 1:
            X, Y = coords.split(",")
            parts.append(f'<circle cx="{X}" cy="{Y}" r="3" fill="{colour}"><title>{esc(name)}</title></circle>')
        else:
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6"{_dash(dash)} points="{coords}" '
                         f'data-series="{esc(name)}"><title>{esc(name)}</title></polyline>')
        lx = ml + (i % 4) * (pw / 4)
        ly = height + 4 + 18 * (i // 4)
        parts.append(f'<line x1="{lx:.1f}" y1="{ly - 7}" x2="{lx + 20:.1f}" y2="{ly - 7}" stroke="{colour}" '
                     f'stroke-width="2.2"{_dash(dash)}/>'
                     f'<text x="{lx + 24:.1f}" y="{ly - 3}" font-size="11">{esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(values: dict[str, float], *, title: str, ylabel: str, width: int = 680, height: int = 280,
              styles: dict[str, Style] | None = None) -> str:
    """An inline SVG bar chart, one bar per named value (non-finite values drawn as missing);
    ``styles`` as in ``line_chart`` (a dashed look is a paler bar with a dashed outline)."""
    ml, mr, mt, mb = 62, 14, 30, 70
    pw, ph = width - ml - mr, height - mt - mb
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
             f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" font-weight="600">{esc(title)}</text>']
    finite = [float(v) for v in values.values() if v is not None and math.isfinite(float(v))]
    if not finite:
        parts.append(f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" font-size="13" '
                     f'fill="#888">no data</text></svg>')
        return "".join(parts)
    top = (max(max(finite), 0.0) or 1.0) * 1.08          # headroom for the value labels
    ticks = nice_ticks(0.0, top, 5)
    top = max(top, ticks[-1] if ticks else top)
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in ticks:
        Y = mt + ph - t / top * ph
        parts.append(f'<line x1="{ml}" y1="{Y:.1f}" x2="{ml + pw}" y2="{Y:.1f}" stroke="#eee"/>'
                     f'<text x="{ml - 6}" y="{Y + 4:.1f}" text-anchor="end" font-size="11">{_tick_label(t)}</text>')
    n = len(values)
    slot = pw / max(n, 1)
    looks = _looks(list(values), styles)
    for i, (name, v) in enumerate(values.items()):
        cx = ml + slot * (i + 0.5)
        if v is not None and math.isfinite(float(v)):
            h = max(float(v), 0.0) / top * ph
            colour, dash = looks[name]
            look = f'fill="{colour}"' + (f' fill-opacity="0.45" stroke="{colour}" stroke-width="1.5"{_dash(dash)}'
                                         if dash else "")
            parts.append(f'<rect x="{cx - slot * 0.35:.1f}" y="{mt + ph - h:.1f}" width="{slot * 0.7:.1f}" '
                         f'height="{h:.1f}" {look}><title>{esc(name)}: {fmt(float(v))}</title></rect>'
                         f'<text x="{cx:.1f}" y="{mt + ph - h - 3:.1f}" text-anchor="middle" font-size="10">{fmt(float(v), 3)}</text>')
        parts.append(f'<text x="{cx:.1f}" y="{mt + ph + 14}" text-anchor="end" font-size="11" '
                     f'transform="rotate(-30 {cx:.1f} {mt + ph + 14})">{esc(name)}</text>')
    parts.append(f'<text x="14" y="{mt + ph / 2:.1f}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {mt + ph / 2:.1f})">{esc(ylabel)}</text></svg>')
    return "".join(parts)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    out = ["<table><thead><tr>", *(f"<th>{esc(h)}</th>" for h in headers), "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>")
        for v in row:
            cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            out.append(f"<td{cls}>{esc(fmt(v))}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def md_escape(s: object) -> str:
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(md_escape(fmt(v)) for v in row) + " |")
    return "\n".join(lines)


def html_page(title: str, sections: Sequence[tuple[str, str]], subtitle: str = "") -> str:
    """A complete HTML document: inline CSS, one ``<h2>`` per (heading, inner-HTML) section."""
    body = [f"<h1>{esc(title)}</h1>"]
    if subtitle:
        body.append(f'<p class="note">{esc(subtitle)}</p>')
    for heading, inner in sections:
        body.append(f"<section><h2>{esc(heading)}</h2>{inner}</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
