"""Plotly.js under a Content-Security-Policy without ``'unsafe-inline'`` styles.

When it loads, plotly.min.js adds its own CSS by creating ``<style>``
elements (its global rules for the plot, the mode bar and the notifier, and
maplibre's for map traces), which a policy without ``'unsafe-inline'`` in
``style-src`` blocks. It creates each one only if no element with that id
exists, and leaves the global one alone when that element has the class
``no-inline-styles``, which is Plotly's own hook for strict CSP.

So this module reads the installed bundle once and gives the page:

* ``plotly_css()``: the same rules as a stylesheet, served from this origin
  (``GET /vendor/plotly.css``), with Plotly's selector shorthands expanded
  exactly as its loader does (``X`` is ``.js-plotly-plot .plotly``, ``Y``
  is ``.plotly-notifier``);
* ``style_ids()``: the ids of the fixed ``<style>`` elements, for which the
  page carries empty placeholders, so that Plotly creates none.

If a future Plotly lays its bundle out differently, both come back empty:
the charts still draw, the browser reports the blocked styles, and the CSP
browser test (``tests/edge/test_security_browser.py``) says which.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from functools import cache
from importlib import resources

GLOBAL_ID = "plotly.js-style-global"
_RULES_START = re.compile(r'\{"X,X div":')
_PAIR = re.compile(
    r"""\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[A-Za-z_$][\w$]*)\s*:\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s*([,}])"""
)
_FIXED_STYLE = re.compile(
    r'getElementById\("([0-9a-f]{64})"\)\)\{var (\w+)=document\.createElement\("style"\);'
    r"\2\.id=\"\1\",\2\.textContent=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
)


def _bundle() -> str:
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


def _string(literal: str) -> str:
    """A JS string literal's text (these hold no escapes but quotes and backslashes), or a bare key."""
    if literal[:1] not in ("'", '"'):
        return literal
    return re.sub(r"\\(.)", r"\1", literal[1:-1])


def _global_rules(js: str) -> list[tuple[str, str]]:
    start = _RULES_START.search(js)
    if not start:
        return []
    pos, rules = start.start() + 1, []
    while True:
        m = _PAIR.match(js, pos)
        if not m:
            return []
        rules.append((_string(m[1]), _string(m[2])))
        pos = m.end()
        if m[3] == "}":
            return rules


@cache
def _extract() -> tuple[str, tuple[str, ...]]:
    js = _bundle()
    css = []
    # Plotly inserts each rule at index 0, so the first it defines ends up last.
    for selector, body in reversed(_global_rules(js)):
        selector = re.sub(r"^,", " ,", selector).replace("X", ".js-plotly-plot .plotly")
        css.append(f"{selector.replace('Y', '.plotly-notifier')}{{{body}}}")
    ids = []
    for m in _FIXED_STYLE.finditer(js):
        ids.append(m[1])
        css.append(_string(m[3]))
    return "\n".join(css) + "\n", tuple(ids)


_DECLARATIONS = re.compile(r"CSS_DECLARATIONS=(\[(?:\[\"[\w-]+\",\"[\w-]+\"\],?)+\])")


@cache
def style_attribute_hashes() -> tuple[str, ...]:
    """CSP hashes of the only ``style`` attributes Plotly sets as text.

    Everything else it styles through the CSSOM (``element.style.x = ...``),
    which a policy allows; these two it writes with ``setAttribute``: an
    empty ``style=""`` on a colour bar's fills, and the ``image-rendering``
    declarations on a heat map drawn as an image (``zsmooth: false``), which
    it builds from its ``CSS_DECLARATIONS`` exactly as here. Allowing their
    hashes (with ``'unsafe-hashes'``) allows those two values, no others.
    """
    values = [""]
    m = _DECLARATIONS.search(_bundle())
    if m:
        pairs = json.loads(m[1])
        values.append("".join(f"{name}: {value}; " for name, value in pairs))
    return tuple("sha256-" + base64.b64encode(hashlib.sha256(v.encode()).digest()).decode() for v in values)


def plotly_css() -> str:
    return _extract()[0]


def style_ids() -> tuple[str, ...]:
    return _extract()[1]
