"""``features.viewer``: the static dashboard page, opened in headless Chromium (Debian's chromium and
chromium-driver, which ``make install`` installs), shows the feature the URL or the search box
names, and every token as text, never markup; its content security policy, the one
docs/dashboards.md states, keeps even markup that got into the page from reaching a server on the
loopback."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import pathlib
import re
import threading
from typing import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from features.neuronpedia import ActivationExample, DashboardFeature, feature_dict, interval_bounds, top_group_bounds
from features.viewer import write_viewer
from tests.conftest import REPO, setup_arguments, wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCRIPT = "<script>window.pwned=1</script>"
IMAGE = '<img src=x onerror="window.pwned=1">'


@contextlib.contextmanager
def chromium_driver(tmp_dir: pathlib.Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium through selenium, its profile in ``tmp_dir``: no proxy, so that it reaches
    the loopback (where the tests' servers listen), and every host name but 127.0.0.1 unresolvable."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} missing: `make install` installs them "
                                "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-extensions", f"--user-data-dir={tmp_dir}", "--window-size=1200,900",
                     "--no-proxy-server", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver: webdriver.Chrome, path: str, feature: int) -> None:
    """Opens the viewer page at ``path`` on ``feature`` (``#feature=N``) and waits until it shows it."""
    driver.get(f"{pathlib.Path(path).resolve().as_uri()}#feature={feature}")
    wait_shown(driver, feature)


def wait_shown(driver: webdriver.Chrome, feature: int) -> None:
    """Waits until the page has rendered ``feature`` (a hash change renders after the event that made it)."""
    shown = lambda d: d.find_element("id", "feature-view").get_attribute("data-feature") == str(feature)
    WebDriverWait(driver, 30, poll_frequency=0.02).until(shown)


def texts(driver: webdriver.Chrome, selector: str) -> list[str]:
    """The text of every element ``selector`` finds, read in the page (exact: whitespace kept)."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)",
                                 selector)


def dashboard() -> dict:
    """Three features: 7 (two top examples and two intervals), 3 (tokens that are markup) and 11 (dead)."""
    live = DashboardFeature(
        feature_index=7, neg_str=[" the", "\t"], neg_values=[-1.25, -0.5], pos_str=[" dog", " mat"],
        pos_values=[1.5, 1.125], density=0.0125, histogram_values=[0.2, 0.6, 1.0, 1.4, 1.8],
        histogram_heights=[10, 5, 3, 0, 1], logits_histogram_heights=[1, 2], logits_histogram_values=[-1.0, 1.0],
        activations=[
            ActivationExample(*top_group_bounds(2.0), ["The", " cat", " sat", "\n", "on"], [0, 0.5, 2.0, 0, 0.25], 2),
            ActivationExample(*top_group_bounds(2.0), ["a", " cat"], [0, 1.5], 1),
            ActivationExample(*interval_bounds(1.0, 2.0, 0.25), ["x", " cat"], [0, 1.25], 1),
            ActivationExample(*interval_bounds(0.0, 1.0, 0.75), ["y", " cat", "!"], [0, 0.5, 0], -1)])
    hostile = DashboardFeature(
        feature_index=3, neg_str=[IMAGE], neg_values=[-2.0], pos_str=[SCRIPT, "\"'"], pos_values=[1.0, 0.5],
        density=0.5, histogram_values=[0.5], histogram_heights=[4], logits_histogram_heights=[],
        logits_histogram_values=[],
        activations=[ActivationExample(*top_group_bounds(1.0), [SCRIPT, IMAGE, "\"'", "\n", "&amp;"],
                                       [1.0, 0.5, 0.25, 0, 0.125], 0)])
    dead = DashboardFeature(feature_index=11, neg_str=[], neg_values=[], pos_str=[], pos_values=[], density=0,
                            histogram_values=[], histogram_heights=[], logits_histogram_heights=[],
                            logits_histogram_values=[], activations=[])
    return {"model_id": "tiny-qwen", "layer": 12, "sae_set": "res-sae", "key": "layers.12.output",
            "features": [feature_dict(f) for f in (live, hostile, dead)]}


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    return write_viewer(str(tmp_path_factory.mktemp("viewer")), dashboard())


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with chromium_driver(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_data_js_is_one_line_of_ascii_no_script_can_end(tmp_path):
    data = {"features": [{"tokens": ["</script><!--", "a&b", "\u2028\u2029", "é"]}]}
    write_viewer(str(tmp_path), data)
    text = (tmp_path / "data.js").read_text(encoding="ascii")
    assert text == ('const DASHBOARD = {"features": [{"tokens": ["\\u003c/script\\u003e\\u003c!--", "a\\u0026b", '
                    '"\\u2028\\u2029", "\\u00e9"]}]};\n')
    assert json.loads(text.removeprefix("const DASHBOARD = ").removesuffix(";\n")) == data


def test_the_page_ships_with_the_package_and_names_nothing_on_the_network(tmp_path):
    assert {"viewer.html", "viewer.js"} <= set(setup_arguments()["package_data"]["features"])
    page, code = ((REPO / "features" / name).read_text() for name in ("viewer.html", "viewer.js"))
    assert pathlib.Path(write_viewer(str(tmp_path), {})).read_text() == page
    assert (tmp_path / "viewer.js").read_text() == code
    assert re.findall(r"\ssrc=\"([^\"]*)\"", page) == ["data.js", "viewer.js"]
    scripts = re.findall(r"<script\b[^>]*>", re.sub(r"<!--.*?-->", "", page, flags=re.S))
    assert scripts == ['<script src="data.js">', '<script src="viewer.js">']  # no inline script, and none allowed:
    assert "unsafe-inline" not in page.split("script-src", 1)[1].split(";", 1)[0]
    source = page + code
    assert re.findall(r"https?://[^\s\"')]*", source) == ["http://www.w3.org/2000/svg"]  # a namespace's name
    for never in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "url(", "@import"):
        assert never not in source


@pytest.mark.slow  # a browser
def test_the_hash_shows_a_feature(driver, page):
    open_page(driver, page, 7)
    assert driver.find_element("id", "feature-title").text == "Feature 7"
    assert driver.find_element("id", "feature-density").text == "1.25%"
    assert driver.find_element("id", "feature-max").text == "2"
    assert texts(driver, "#dashboard-meta") == ["model tiny-qwen · set res-sae · site layers.12.output (layer 12) · "
                                                "3 features"]
    assert len(driver.find_elements("css selector", "#feature-view .hist-bar")) == 5
    assert texts(driver, "#logits-pos .logit-token") == [" dog", " mat"]
    assert texts(driver, "#logits-pos .logit-value") == ["1.5", "1.125"]
    assert texts(driver, "#logits-neg .logit-token") == [" the", "\u2192"]  # a tab, drawn as →
    assert texts(driver, ".group-title") == ["Top activations", "Interval 1 - 2 (contains 25%)",
                                             "Interval 0 - 1 (contains 75%)"]
    first_top = ".group.top .example:first-of-type .token"
    assert texts(driver, first_top) == ["The", " cat", " sat", "\u21b5", "on"]  # the newline drawn as ↵
    assert texts(driver, f"{first_top}.qualifying") == [" sat"]
    assert texts(driver, ".group.interval .example .token.qualifying") == [" cat"]  # the last group's is -1
    spans = driver.find_elements("css selector", first_top)
    assert [s.value_of_css_property("background-color") for s in spans] == [
        "rgba(0, 0, 0, 0)", "rgba(255, 122, 0, 0.25)", "rgba(255, 122, 0, 1)", "rgba(0, 0, 0, 0)",
        "rgba(255, 122, 0, 0.125)"]
    assert [s.get_attribute("title") for s in spans][1:3] == ['0.5  " cat"', '2  " sat"']


@pytest.mark.slow  # a browser
def test_the_search_box_and_the_list_show_other_features(driver, page):
    open_page(driver, page, 7)
    search = driver.find_element("id", "feature-search")
    search.clear()
    search.send_keys("11" + Keys.ENTER)
    wait_shown(driver, 11)
    assert driver.find_element("id", "feature-title").text == "Feature 11"  # the dead one
    assert driver.find_element("id", "feature-density").text == "0% (never fires)"
    assert driver.find_elements("css selector", "#feature-view .hist-bar, #feature-view .token") == []
    assert texts(driver, "#logits-pos td, #logits-neg td") == ["none", "none"]
    search.clear()
    search.send_keys("999")
    driver.find_element("id", "feature-go").click()
    wait_shown(driver, 999)
    assert driver.find_element("id", "feature-title").text == "No feature 999"
    assert texts(driver, "#feature-list a .fl-index") == ["7", "3", "11"]
    driver.find_element("css selector", "#feature-list a[href='#feature=3']").click()
    wait_shown(driver, 3)
    assert driver.find_element("id", "feature-title").text == "Feature 3"
    assert driver.execute_script("return location.hash") == "#feature=3"


@pytest.mark.slow  # a browser
def test_tokens_are_text_never_markup(driver, page):
    open_page(driver, page, 3)
    assert texts(driver, ".group.top .example .token") == [SCRIPT, IMAGE, "\"'", "\u21b5", "&amp;"]
    assert texts(driver, ".token.qualifying") == [SCRIPT]
    assert texts(driver, "#logits-pos .logit-token") == [SCRIPT, "\"'"]
    assert texts(driver, "#logits-neg .logit-token") == [IMAGE]
    assert driver.find_elements("css selector", "#feature-view img, #feature-view script") == []
    assert driver.execute_script("return document.scripts.length") == 2  # data.js and viewer.js
    assert driver.execute_script("return typeof window.pwned") == "undefined"


# What a page could load from the network, each with the directive of the page's policy that
# reports blocking it (Chromium's effectiveDirective). (A form is left out: submitted, it opens a
# window or navigates a frame, and form-action is in the policy string the test asserts.) Markup,
# were the data's strings ever taken as markup ({url}: where it loads from):
MARKUP_LOADS = {"img": ('<img src="{url}">', "img-src"),
                "background": ('<div style="background-image: url({url}); width: 4px; height: 4px"></div>',
                               "img-src"),
                "prefetch": ('<link rel="prefetch" href="{url}">', "default-src"),
                "stylesheet": ('<link rel="stylesheet" href="{url}">', "style-src-elem"),
                "video": ('<video src="{url}"></video>', "media-src"),
                "frame": ('<iframe src="{url}"></iframe>', "frame-src"),
                "object": ('<object data="{url}"></object>', "object-src"),
                "embed": ('<embed src="{url}">', "object-src")}
# and code, were any ever run (BREAK_IN's LOAD, by the URL's last segment):
SCRIPT_LOADS = {"fetch": "connect-src", "xhr": "connect-src", "websocket": "connect-src",
                "events": "connect-src", "beacon": "connect-src", "script": "script-src-elem"}
# Run in the page: feature arguments[0]'s example tokens inserted as markup (what a viewer that
# rendered data as markup would do), its pos_str URLs loaded by script; the policy's violations
# collected in window.violations.
BREAK_IN = """
const data = DASHBOARD.features.find((f) => f.feature_index === arguments[0]);
window.violations = [];
document.addEventListener("securitypolicyviolation", (e) => window.violations.push(e.effectiveDirective));
const host = document.createElement("div");
host.innerHTML = data.activations[0].tokens.join("");
document.body.appendChild(host);
const LOAD = {
  fetch: (url) => fetch(url, {mode: "no-cors"}).catch(() => null),
  xhr: (url) => { const request = new XMLHttpRequest(); request.open("GET", url); request.send(); },
  websocket: (url) => new WebSocket(url.replace(/^http/, "ws")),
  events: (url) => new EventSource(url),
  beacon: (url) => navigator.sendBeacon(url, "x"),
  script: (url) => document.body.appendChild(Object.assign(document.createElement("script"), {src: url})),
};
for (const url of data.pos_str) LOAD[url.split("/").pop()](url);
"""
POLICY = 'meta[http-equiv="Content-Security-Policy"]'


def documented_policy() -> str:
    """The viewer's content security policy as docs/dashboards.md states it."""
    text = (REPO / "docs" / "dashboards.md").read_text()
    return re.search(r"content\s+security\s+policy,\s+`([^`]+)`", text).group(1)


@contextlib.contextmanager
def loopback_server(handler: type) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 (a free port) from a thread; yields the server's base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def counting_handler(requests: list[str]) -> type:
    """A handler that answers every request with an empty 200 and appends "METHOD PATH" to ``requests``."""
    class Counting(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            requests.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_HEAD = do_OPTIONS = answer

        def log_message(self, *args) -> None:
            pass
    return Counting


def reaching_dashboard(base: str) -> dict:
    """One feature, 5, whose example tokens are MARKUP_LOADS' markup and whose promoted tokens are
    SCRIPT_LOADS' URLs, all at ``base``."""
    markup = [element.format(url=f"{base}/{name}") for name, (element, _) in MARKUP_LOADS.items()]
    urls = [f"{base}/{name}" for name in SCRIPT_LOADS]
    feature = DashboardFeature(
        feature_index=5, neg_str=[], neg_values=[], pos_str=urls, pos_values=[1.0] * len(urls), density=0.5,
        histogram_values=[0.5], histogram_heights=[1], logits_histogram_heights=[], logits_histogram_values=[],
        activations=[ActivationExample(*top_group_bounds(1.0), markup, [1.0] * len(markup), 0)])
    return {"model_id": "tiny-qwen", "layer": 12, "sae_set": "res-sae", "key": "layers.12.output",
            "features": [feature_dict(feature)]}


@pytest.mark.slow  # a browser
@pytest.mark.parametrize("served", ["from disk", "over http"])
def test_the_policy_keeps_every_load_the_data_could_make_off_the_network(driver, tmp_path, served):
    """A page whose data names a counting server on the loopback: the viewer shows the data as text,
    and the same data taken as markup and as URLs to load by script sends that server no request,
    each load blocked by the page's policy (a violation event per load, so the count of none is no
    accident of timing). Chromium does open a TCP connection, sending nothing, for a blocked frame;
    the count is of requests."""
    requests: list[str] = []
    with loopback_server(counting_handler(requests)) as base, \
            loopback_server(functools.partial(QuietFiles, directory=str(tmp_path))) as viewer:
        page = write_viewer(str(tmp_path), reaching_dashboard(base))
        url = pathlib.Path(page).resolve().as_uri() if served == "from disk" else f"{viewer}/index.html"
        driver.get(f"{url}#feature=5")
        wait_shown(driver, 5)
        assert driver.execute_script("return document.querySelector(arguments[0]).content", POLICY) == \
            documented_policy() == "default-src 'none'; script-src 'self' file:; style-src 'unsafe-inline'; " \
                                   "base-uri 'none'; form-action 'none'"
        assert texts(driver, ".group.top .example .token") == [element.format(url=f"{base}/{name}")
                                                                for name, (element, _) in MARKUP_LOADS.items()]
        driver.execute_script(BREAK_IN, 5)
        blocked = [directive for _, directive in MARKUP_LOADS.values()] + list(SCRIPT_LOADS.values())
        violations = lambda: driver.execute_script("return window.violations")  # noqa: E731
        wait_for(lambda: len(violations()) + len(requests) >= len(blocked), what="every load blocked or arrived")
        assert requests == [], f"the page reached the loopback: {sorted(requests)}"
        assert sorted(violations()) == sorted(blocked)
