"""A static viewer of feature dashboards: one directory with ``index.html`` (the page
``features/viewer.html``, as it is), ``viewer.js`` (its code) and ``data.js`` (the dashboard), to
open from disk in any browser.

The dashboard is ``{model_id, layer, sae_set, key, features}``, each feature a dict as
``features.neuronpedia.feature_dict`` lays it out. It travels as a script, one line
``const DASHBOARD = {...};``: a page opened from ``file://`` may load a script beside it but may not
``fetch()`` a JSON file. The page reaches no network and shows every string as text, never markup.
"""

from __future__ import annotations

import importlib.resources
import json
from typing import Any

from common.files import join, write_bytes

PAGE = "index.html"
DATA = "data.js"  # the names viewer.html's <script src> load
CODE = "viewer.js"

# JSON text is a JavaScript expression, but inside an HTML page `</script>` or `<!--` in a string
# would end or change the script element it sits in (where the line is ever inlined), so these
# are written as \\u escapes too. U+2028 and U+2029 (line terminators in JavaScript before ES2019)
# need no entry: ensure_ascii already writes them as \\u2028 and \\u2029.
SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def data_script(dashboard: dict[str, Any]) -> str:
    """``dashboard`` as data.js: one line that sets the global ``DASHBOARD``, ASCII only."""
    return "const DASHBOARD = " + json.dumps(dashboard, ensure_ascii=True).translate(SCRIPT_ESCAPES) + ";\n"


def write_viewer(directory: str, dashboard: dict[str, Any]) -> str:
    """Writes the viewer of ``dashboard`` into ``directory`` (local or ``gs://``); returns the
    page's path."""
    page = join(directory, PAGE)
    sources = importlib.resources.files(__package__)
    write_bytes(page, sources.joinpath("viewer.html").read_bytes())
    write_bytes(join(directory, CODE), sources.joinpath(CODE).read_bytes())
    write_bytes(join(directory, DATA), data_script(dashboard).encode("ascii"))
    return page
