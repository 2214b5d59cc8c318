// The viewer's code (features.viewer writes it as viewer.js beside index.html and data.js): a
// script file, not inline, so that the page's policy allows no inline script at all.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";  // a namespace name, never fetched
  const TOP = -1;  // bin_contains of the top activations' group (features.neuronpedia.TOP_GROUP)
  const view = document.getElementById("feature-view");

  // An element with attributes (setAttribute: text, never markup) and children (strings become
  // text nodes; null is skipped). The only way this page puts data into the document.
  function make(namespace, tag, attributes, children) {
    const node = namespace ? document.createElementNS(namespace, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
    for (const child of children || []) {
      if (child !== null) node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const el = (tag, attributes, ...children) => make(null, tag, attributes, children);
  const svg = (tag, attributes, ...children) => make(SVG, tag, attributes, children);

  // Numbers as the batch files round them (3 places), without trailing zeros.
  const number = (x) => (Number.isFinite(Number(x)) ? String(Number(Number(x).toFixed(3))) : String(x));
  const percent = (share) => number(Number(share) * 100) + "%";

  // Whitespace and control characters drawn visibly, still as text: a newline as ↵, a tab as →, the
  // others as their Unicode control pictures (carriage return ␍, ...). Spaces stay spaces (white-space: pre).
  const SHOWN = {"\n": "\u21b5", "\t": "\u2192", "\u007f": "\u2421"};
  function visible(token) {
    return String(token).replace(/[\u0000-\u001f\u007f]/g,
                                 (c) => SHOWN[c] || String.fromCharCode(0x2400 + c.charCodeAt(0)));
  }

  // The feature's maximum: its top group's bin_max, else the largest value of its examples.
  function featureMax(feature) {
    const activations = feature.activations || [];
    const top = activations.find((a) => a.bin_contains === TOP);
    if (top) return Number(top.bin_max);
    let largest = 0;  // a loop, not Math.max(...values): a long run would overflow the call's arguments
    for (const a of activations) for (const v of a.values || []) largest = Math.max(largest, Number(v));
    return largest;
  }

  // A token's background: its share of the maximum; values <= 0 stay unshaded.
  function shade(value, maximum) {
    const share = Number(value) / maximum;
    if (!(Number(value) > 0) || !(maximum > 0)) return "";
    return "rgba(255, 122, 0, " + Math.min(1, share).toFixed(3) + ")";
  }

  function histogram(feature) {
    const centres = feature.freq_hist_data_bar_values || [];
    const heights = (feature.freq_hist_data_bar_heights || []).map(Number);
    if (!centres.length) return el("p", {class: "empty"}, "No activations: this feature never fires.");
    const width = 600, plot = 110, tallest = heights.reduce((m, h) => Math.max(m, h), 1), step = width / centres.length;
    const bars = centres.map((centre, i) => {
      const h = heights[i] > 0 ? Math.max(1, (heights[i] / tallest) * plot) : 0;
      return svg("rect", {class: "hist-bar", x: i * step, y: plot - h, width: Math.max(step - 1, 0.5), height: h},
                 svg("title", {}, number(centre) + ": " + (heights[i] || 0)));
    });
    return svg("svg", {class: "histogram", viewBox: "0 0 " + width + " " + (plot + 18), role: "img",
                       "aria-label": "activation histogram"},
               ...bars,
               svg("text", {class: "hist-label", x: 0, y: plot + 14}, number(centres[0])),
               svg("text", {class: "hist-label", x: width, y: plot + 14, "text-anchor": "end"},
                   number(centres[centres.length - 1])));
  }

  function logitTable(id, caption, strings, values) {
    const rows = (strings || []).map((token, i) =>
      el("tr", {}, el("td", {class: "logit-token", title: JSON.stringify(String(token))}, visible(token)),
         el("td", {class: "logit-value"}, number((values || [])[i]))));
    if (!rows.length) rows.push(el("tr", {}, el("td", {class: "empty"}, "none")));
    return el("table", {id: id}, el("caption", {}, caption), el("tbody", {}, ...rows));
  }

  function example(activation, maximum) {
    const values = activation.values || [];
    const tokens = (activation.tokens || []).map((token, i) => {
      const span = el("span", {class: i === activation.qualifying_token_index ? "token qualifying" : "token",
                               title: number(values[i]) + "  " + JSON.stringify(String(token))},
                      visible(token));
      span.style.backgroundColor = shade(values[i], maximum);
      return span;
    });
    const at = values[activation.qualifying_token_index];
    return el("div", {class: "example"},
              el("span", {class: "example-value"}, at === undefined ? "" : number(at)),
              el("span", {class: "tokens"}, ...tokens));
  }

  // Examples by group, the top activations first, then the intervals in the file's order (high to low).
  function groups(activations) {
    const byBounds = new Map();
    for (const a of activations) {
      const key = [a.bin_min, a.bin_max, a.bin_contains].join(" ");
      if (!byBounds.has(key)) byBounds.set(key, []);
      byBounds.get(key).push(a);
    }
    const all = [...byBounds.values()];
    return [...all.filter((g) => g[0].bin_contains === TOP), ...all.filter((g) => g[0].bin_contains !== TOP)];
  }

  function examples(feature, maximum) {
    const found = groups(feature.activations || []);
    if (!found.length) return [el("p", {class: "empty"}, "No examples.")];
    return found.map((group) => {
      const bounds = group[0], top = bounds.bin_contains === TOP;
      const title = top ? "Top activations"
        : "Interval " + number(bounds.bin_min) + " - " + number(bounds.bin_max) +
          " (contains " + percent(bounds.bin_contains) + ")";
      return el("section", {class: top ? "group top" : "group interval"},
                el("h3", {class: "group-title"}, title), ...group.map((a) => example(a, maximum)));
    });
  }

  function showFeature(feature) {
    const maximum = featureMax(feature);
    const density = Number(feature.frac_nonzero) > 0 ? percent(feature.frac_nonzero) : "0% (never fires)";
    view.replaceChildren(
      el("h2", {id: "feature-title"}, "Feature " + feature.feature_index),
      el("dl", {class: "stats"},
         el("div", {}, el("dt", {}, "density"), el("dd", {id: "feature-density"}, density)),
         el("div", {}, el("dt", {}, "max activation"), el("dd", {id: "feature-max"}, number(maximum)))),
      el("h3", {}, "Activation histogram"), histogram(feature),
      el("h3", {}, "Logits"),
      el("div", {class: "logits"},
         logitTable("logits-pos", "Promoted", feature.pos_str, feature.pos_values),
         logitTable("logits-neg", "Suppressed", feature.neg_str, feature.neg_values)),
      ...examples(feature, maximum));
  }

  function message(title, text) {
    view.replaceChildren(el("h2", {id: "feature-title"}, title), el("p", {class: "empty"}, text));
  }

  const data = typeof DASHBOARD === "undefined" ? null : DASHBOARD;  // undefined: data.js did not load
  if (!data) {
    message("No data", "data.js did not load: it must sit beside this page (features.viewer writes both).");
    return;
  }
  const features = data.features || [];
  const byIndex = new Map(features.map((f) => [String(f.feature_index), f]));
  const links = new Map();

  // Shows the feature whose index is `requested` (a string), or says there is none.
  function show(requested) {
    const feature = byIndex.get(requested);
    if (feature) showFeature(feature);
    else if (!features.length) message("No features", "This dashboard holds no features.");
    else message("No feature " + requested, "There is no feature " + requested + " in this dashboard.");
    view.setAttribute("data-feature", requested);  // for tests: what the view shows now
    for (const [index, link] of links) link.classList.toggle("current", index === requested);
    if (links.has(requested)) links.get(requested).scrollIntoView({block: "nearest"});
  }

  // Selecting goes through the URL's hash (#feature=N): links, back and forward all work alike.
  function select(requested) {
    const hash = "#feature=" + encodeURIComponent(requested);
    if (location.hash === hash) show(requested);
    else location.hash = hash;
  }
  const fromHash = () => {
    const match = /^#feature=(.*)$/.exec(location.hash);
    if (!match) return null;
    try {
      return decodeURIComponent(match[1]);
    } catch (e) {  // a malformed escape (#feature=%): shown as typed
      return match[1];
    }
  };

  document.title = [data.model_id, data.sae_set, data.key].filter((x) => x !== undefined).join(" · ") + " features";
  document.getElementById("dashboard-meta").textContent =
    "model " + data.model_id + " · set " + data.sae_set + " · site " + data.key + " (layer " + data.layer + ") · " +
    features.length + (features.length === 1 ? " feature" : " features");

  const list = document.createDocumentFragment();
  for (const feature of features) {
    const index = String(feature.feature_index);
    const density = Number(feature.frac_nonzero) > 0 ? percent(feature.frac_nonzero) : "dead";
    const link = el("a", {href: "#feature=" + encodeURIComponent(index), class: "feature-link"},
                    el("span", {class: "fl-index"}, index), el("span", {class: "fl-density"}, density),
                    el("span", {class: "fl-max"}, "max " + number(featureMax(feature))));
    links.set(index, link);
    list.appendChild(el("li", {}, link));
  }
  document.getElementById("feature-list").appendChild(list);

  document.getElementById("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const requested = document.getElementById("feature-search").value.trim();
    if (requested) select(requested);
  });
  const first = features.length ? String(features[0].feature_index) : "";
  window.addEventListener("hashchange", () => show(fromHash() ?? first));
  show(fromHash() ?? first);
})();
