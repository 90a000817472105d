// The explorer app: one SAE's latents, images and sweep, from the data chunks of
// docs/explorer-format.md. Plain JavaScript, no network: chunks are scripts that call
// actcache_chunk(name, payload), so it works from file:// and over http alike.
// Views (the location's hash): "" latent table, #latent=ID, #image=ID, #patch=ID/P, #sweep=ID, #classes.
"use strict";
(function () {
  const PAGE_ROWS = 50;      // table rows rendered at once (never the whole width)
  const LRU_MAX = 8;         // detail and image chunks kept in memory (tables are kept: ~40 B per latent)
  const BROWSE_PAGE = 48;    // thumbnails per page in the image browser
  const DEFAULT_DEFS = {
    id: "the latent's index in the SAE (0 .. width - 1)",
    freq: "fraction of tokens where the latent is non-zero",
    max_act: "largest activation of the latent",
    mean_act: "mean activation where the latent is non-zero",
    dec_norm: "L2 norm of the latent's decoder row",
    best_class: "the class whose one-latent probe has the highest AP",
    best_ap: "average precision of that probe; chance = the class's prevalence",
    act: "the latent's activation",
    cos: "cosine between decoder rows",
    hist: "tokens per activation bin",
    chance: "AP of a random ranking: the class's prevalence among the probe's images",
    quantiles: "examples sampled from bins between the median and the max of the latent's non-zero activations",
    neighbours: "latents with the largest cosine between decoder rows",
    patches: "per token: its top latents by activation (non-zero only)",
  };

  const S = {
    meta: null, tables: new Map(), lru: new Map(), inflight: new Map(), pending: new Map(),
    cols: null, order: null, orderKey: "", seq: 0,
    table: { sort: "id", desc: false, page: 0, fmin: "", fmax: "", amin: "", cls: "", apmin: "", above: false },
    browse: { cls: "", page: 0 },
  };
  window.__explorer = S;

  // ---- chunk loading ----------------------------------------------------------------------
  // A chunk is a script calling actcache_chunk(name, payload); document.currentScript names the
  // request it answers (so two SAEs' "images/0003" never collide). Scripts are removed once run.
  window.actcache_chunk = function (name, payload) {
    const s = document.currentScript;
    const entry = S.pending.get(s && s.dataset.key ? s.dataset.key : name);
    if (entry) { entry.payload = payload; entry.got = true; }
  };

  function loadScript(key, src) {
    return new Promise(function (resolve, reject) {
      const s = document.createElement("script");
      const entry = { got: false, payload: null };
      S.pending.set(key, entry);
      s.dataset.key = key;
      s.src = src;
      s.onload = function () {
        S.pending.delete(key); s.remove();
        if (entry.got) resolve(entry.payload); else reject(new Error(src + " did not call actcache_chunk"));
      };
      s.onerror = function () { S.pending.delete(key); s.remove(); reject(new Error("cannot load " + src)); };
      document.head.appendChild(s);
    });
  }

  // keep: kept for good (meta, table chunks); otherwise in the LRU of LRU_MAX entries
  function chunk(key, src, keep) {
    if (S.tables.has(key)) return Promise.resolve(S.tables.get(key));
    if (S.lru.has(key)) { const v = S.lru.get(key); S.lru.delete(key); S.lru.set(key, v); return Promise.resolve(v); }
    if (S.inflight.has(key)) return S.inflight.get(key);
    const p = loadScript(key, src).then(function (v) {
      S.inflight.delete(key);
      if (keep) S.tables.set(key, v);
      else { S.lru.set(key, v); while (S.lru.size > LRU_MAX) S.lru.delete(S.lru.keys().next().value); }
      return v;
    }, function (e) { S.inflight.delete(key); throw e; });
    S.inflight.set(key, p);
    return p;
  }
  const pad4 = function (n) { return String(n).padStart(4, "0"); };
  const own = function (name, keep) { return chunk(name, "data/" + name + ".js", keep); };
  const tableChunk = function (c) { return own("latents/table-" + pad4(c), true); };
  const detailChunk = function (c) { return own("latents/detail-" + pad4(c), false); };
  const imageChunk = function (id) { return own("images/" + pad4(id), false); };
  function nTables() { return Math.ceil(S.meta.width / S.meta.chunk); }

  // every table chunk, as typed columns indexed by latent id (for sorting and filtering)
  async function allColumns(status) {
    if (S.cols) return S.cols;
    const n = nTables(), W = S.meta.width;
    let done = 0;
    const parts = await Promise.all(Array.from({ length: n }, function (_, c) {
      return tableChunk(c).then(function (t) { done++; if (status) status.textContent = "loading latents: " + done + " / " + n + " chunks"; return t; });
    }));
    const cols = { freq: new Float64Array(W), max_act: new Float64Array(W), mean_act: new Float64Array(W),
      dec_norm: new Float64Array(W), best_class: new Int32Array(W), best_ap: new Float64Array(W) };
    for (const t of parts) {
      for (const k of Object.keys(cols)) {
        const src = t[k], dst = cols[k];
        for (let j = 0; j < src.length; j++) dst[t.start + j] = src[j] === null ? NaN : src[j];
      }
    }
    S.cols = cols;
    return cols;
  }

  // one latent's table row (loads its table chunk only)
  async function row(id) {
    const c = Math.floor(id / S.meta.chunk), t = await tableChunk(c), j = id - t.start;
    const r = { id: id };
    for (const k of ["freq", "max_act", "mean_act", "dec_norm", "best_class", "best_ap", "best_ap_lo", "best_ap_hi"]) r[k] = t[k] ? t[k][j] : null;
    return r;
  }

  // ---- DOM and numbers --------------------------------------------------------------------
  function el(tag, attrs) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) {
      const v = attrs[k];
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (let i = 2; i < arguments.length; i++) {
      const c = arguments[i];
      if (c === null || c === undefined || c === false) continue;
      if (Array.isArray(c)) c.forEach(function (x) { if (x) e.append(x); }); else e.append(c);
    }
    return e;
  }
  // replaceChildren would write a null part as the text "null"
  function show(node) { node.replaceChildren(...Array.prototype.slice.call(arguments, 1).filter(function (x) { return x; })); }
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }
  function def(key) { return (S.meta.definitions || {})[key] || DEFAULT_DEFS[key] || key; }
  // a number with its definition (and n, chance) as tooltip; data-value keeps the exact value
  function num(key, v, extra) {
    return el("span", { class: "num", title: def(key) + (extra ? "; " + extra : ""), "data-key": key,
      "data-value": v === null || v === undefined ? "" : String(v), text: fmt(v) });
  }
  function className(label) {
    if (label === null || label === undefined || label < 0) return "–";
    return (S.meta.classes || {})[String(label)] || "class " + label;
  }
  function chance(label) { const p = (S.meta.probe_prevalence || {})[String(label)]; return p === undefined ? null : p; }
  const nTokens = function () { return "n = " + S.meta.n_tokens + " tokens"; };
  const probeN = function () { return S.meta.probe_n === null || S.meta.probe_n === undefined ? "n not recorded" : "n = " + S.meta.probe_n + " images"; };
  const nProbe = function (label) { return probeN() + "; chance (prevalence of " + className(label) + ") = " + fmt(chance(label)); };
  const stepLink = function (a, rel) { a.dataset.step = rel; return a; };
  const latentLink = function (id, text) { return el("a", { href: "#latent=" + id, class: "latent", "data-id": id, text: text === undefined ? String(id) : text }); };
  function explorable(id) { return S.meta.images.some(function (im) { return im.id === id; }); }

  // ---- heatmaps ---------------------------------------------------------------------------
  function decodeHeat(b64) {
    const s = atob(b64), out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  // a grid x grid canvas (scaled up by CSS) holding each patch's heat as red alpha
  function heatCanvas(heatB64) {
    const g = S.meta.grid;
    if (!g || !heatB64) return null;
    const heat = decodeHeat(heatB64), cv = el("canvas", { width: g, height: g, class: "heat" });
    const ctx = cv.getContext("2d"), img = ctx.createImageData(g, g), pot = S.meta.patch_of_token;
    for (let t = 0; t < heat.length && t < pot.length; t++) {
      const p = pot[t];
      if (p < 0) continue;
      img.data[4 * p] = 255; img.data[4 * p + 3] = Math.round(heat[t] * 0.7);
    }
    ctx.putImageData(img, 0, 0);
    return cv;
  }
  // a grid x grid canvas marking one token's patch (a quantile example: where its act was taken)
  function tokenCanvas(tok) {
    const g = S.meta.grid, p = tok === undefined || tok === null ? -1 : S.meta.patch_of_token[tok];
    if (!g || p === undefined || p < 0) return null;
    const cv = el("canvas", { width: g, height: g, class: "mark" }), ctx = cv.getContext("2d");
    ctx.fillStyle = "rgba(255, 0, 0, 0.6)";
    ctx.fillRect(p % g, Math.floor(p / g), 1, 1);
    return cv;
  }
  function thumbSrc(id) { return (S.meta.image_thumbs || {})[String(id)] || null; }
  function tokenName(tok) {
    if (tok === undefined || tok === null) return "";
    const p = S.meta.patch_of_token[tok];
    return p >= 0 ? "patch " + p : "token " + tok + " (not a patch)";
  }
  function exampleFig(ex) {
    const src = thumbSrc(ex.img);
    const box = el("div", { class: "thumb" }, src ? el("img", { src: src, alt: "image " + ex.img }) : null,
      ex.heat ? heatCanvas(ex.heat) : tokenCanvas(ex.tok));
    const cap = explorable(ex.img) ? el("a", { href: "#image=" + ex.img, text: "image " + ex.img }) : el("span", { text: "image " + ex.img });
    const where = ex.tok === undefined || ex.tok === null ? null : el("span", { class: "muted", text: " · " + tokenName(ex.tok) });
    return el("figure", { class: "example", "data-img": ex.img }, box, el("figcaption", {}, cap, where, " · ", num("act", ex.act)));
  }

  // ---- histogram (inline SVG) -------------------------------------------------------------
  // only the bins from the first to the last non-zero one are drawn (the edges may span decades)
  function histogram(allCounts, allEdges) {
    let a = allCounts.findIndex(function (c) { return c > 0; }), b = allCounts.length - 1;
    while (b > a && allCounts[b] === 0) b--;
    if (a < 0) { a = 0; b = allCounts.length - 1; }
    const counts = allCounts.slice(a, b + 1), edges = allEdges.slice(a, b + 2);
    const geometric = edges.length > 2 && edges[0] > 0 && Math.abs(edges[2] / edges[1] - edges[1] / edges[0]) < 1e-3 * (edges[1] / edges[0]);
    const W = 420, H = 150, L = 48, B = 30, n = counts.length, max = Math.max(1, ...counts);
    const ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg");
    const mk = function (tag, a, text) { const e = document.createElementNS(ns, tag); for (const k in a) e.setAttribute(k, a[k]); if (text !== undefined) e.textContent = text; svg.append(e); return e; };
    svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("class", "hist");
    const bw = (W - L - 8) / Math.max(1, n);
    counts.forEach(function (c, i) {
      const h = (H - B - 8) * c / max;
      const r = mk("rect", { x: L + i * bw, y: H - B - h, width: Math.max(1, bw - 1), height: h, fill: "#5c6bc0" });
      const t = document.createElementNS(ns, "title");
      t.textContent = c + " tokens with activation in [" + fmt(edges[i]) + ", " + fmt(edges[i + 1]) + ")";
      r.append(t);
    });
    mk("line", { x1: L, y1: H - B, x2: W - 8, y2: H - B, stroke: "#333" });
    mk("line", { x1: L, y1: 8, x2: L, y2: H - B, stroke: "#333" });
    mk("text", { x: L - 4, y: 14, "text-anchor": "end", "font-size": 10 }, String(max));
    mk("text", { x: L - 4, y: H - B, "text-anchor": "end", "font-size": 10 }, "0");
    if (edges.length) {
      mk("text", { x: L, y: H - B + 12, "font-size": 10 }, fmt(edges[0]));
      mk("text", { x: W - 8, y: H - B + 12, "text-anchor": "end", "font-size": 10 }, fmt(edges[edges.length - 1]));
    }
    mk("text", { x: (L + W) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11 }, geometric ? "activation (log-spaced bins)" : "activation");
    mk("text", { x: 12, y: (H - B) / 2, "font-size": 11, transform: "rotate(-90 12 " + (H - B) / 2 + ")", "text-anchor": "middle" }, "tokens");
    return svg;
  }

  // ---- the latent table -------------------------------------------------------------------
  const COLUMNS = ["id", "freq", "max_act", "mean_act", "dec_norm", "best_class", "best_ap"];
  function filtered() { const t = S.table; return t.fmin !== "" || t.fmax !== "" || t.amin !== "" || t.cls !== "" || t.apmin !== "" || t.above; }

  // the ids to list, in order: all latents by id when neither sorted nor filtered (no chunk needed)
  async function tableOrder(status) {
    const t = S.table;
    if (t.sort === "id" && !t.desc && !filtered()) return null;
    const key = [t.sort, t.desc, t.fmin, t.fmax, t.amin, t.cls, t.apmin, t.above].join("|");
    if (S.orderKey === key) return S.order;
    const c = await allColumns(status), W = S.meta.width, ids = [];
    const fmin = t.fmin === "" ? -Infinity : +t.fmin, fmax = t.fmax === "" ? Infinity : +t.fmax;
    const amin = t.amin === "" ? -Infinity : +t.amin, apmin = t.apmin === "" ? -Infinity : +t.apmin, cls = t.cls === "" ? null : +t.cls;
    for (let i = 0; i < W; i++) {
      if (c.freq[i] < fmin || c.freq[i] > fmax || c.max_act[i] < amin) continue;
      if (cls !== null && c.best_class[i] !== cls) continue;
      if (t.apmin !== "" && !(c.best_ap[i] >= apmin)) continue;
      if (t.above && !(c.best_ap[i] > (chance(c.best_class[i]) ?? Infinity))) continue;
      ids.push(i);
    }
    const order = Uint32Array.from(ids);
    if (t.sort !== "id") {
      const col = c[t.sort === "best_class" ? "best_class" : t.sort], sign = t.desc ? -1 : 1;
      order.sort(function (a, b) {  // missing values (null AP) last either way
        const x = col[a], y = col[b], nx = Number.isNaN(x), ny = Number.isNaN(y);
        if (nx || ny) return nx === ny ? a - b : nx ? 1 : -1;
        return x === y ? a - b : sign * (x - y);
      });
    } else if (t.desc) order.reverse();
    S.order = order; S.orderKey = key;
    return order;
  }

  function tableControls(rerender) {
    const t = S.table;
    const input = function (k, label, title) {
      return el("label", { title: title }, label, el("input", { type: "number", step: "any", value: t[k], "data-filter": k,
        onchange: function (e) { t[k] = e.target.value; t.page = 0; rerender(); } }));
    };
    const classes = Object.keys(S.meta.classes || {});
    const sel = el("select", { "data-filter": "cls", onchange: function (e) { t.cls = e.target.value; t.page = 0; rerender(); } },
      el("option", { value: "", text: "any" }),
      classes.map(function (k) { return el("option", { value: k, text: className(k), selected: t.cls === k }); }));
    const above = el("input", { type: "checkbox", "data-filter": "above", checked: t.above,
      onchange: function (e) { t.above = e.target.checked; t.page = 0; rerender(); } });
    return el("div", { class: "controls" },
      input("fmin", "freq ≥", def("freq")), input("fmax", "freq ≤", def("freq")), input("amin", "max act ≥", def("max_act")),
      el("label", { title: def("best_class") }, "best class", sel), input("apmin", "AP ≥", def("best_ap")),
      el("label", { title: "AP above its class's prevalence (chance)" }, "AP > chance", above));
  }

  async function viewTable(app, seq) {
    const t = S.table, m = S.meta;
    const status = el("p", { class: "muted" });
    const rerender = function () { route(); };
    app.replaceChildren(el("h2", { text: m.width + " latents" }), tableControls(rerender), status);
    const order = await tableOrder(status);
    if (seq !== S.seq) return;
    const total = order ? order.length : m.width, pages = Math.max(1, Math.ceil(total / PAGE_ROWS));
    t.page = Math.min(Math.max(0, t.page), pages - 1);
    const ids = [];
    for (let i = t.page * PAGE_ROWS; i < Math.min(total, (t.page + 1) * PAGE_ROWS); i++) ids.push(order ? order[i] : i);
    const rows = await Promise.all(ids.map(row));
    if (seq !== S.seq) return;
    const head = el("tr", {}, COLUMNS.map(function (k) {
      const extra = k === "freq" ? "; " + nTokens() : k === "best_ap" ? "; " + probeN() + "; chance is shown per row" : "";
      return el("th", { class: "sortable" + (t.sort === k ? " sorted" : "") + (k === "best_class" ? " l" : ""), "data-sort": k, title: def(k) + extra + " (click to sort)",
        text: k + (t.sort === k ? (t.desc ? " ▼" : " ▲") : ""),
        onclick: function () { t.desc = t.sort === k ? !t.desc : k !== "id"; t.sort = k; t.page = 0; rerender(); } });
    }), el("th", { title: "AP at chance: the best class's prevalence among the probe's images (" + probeN() + ")", text: "chance" }));
    const body = rows.map(function (r) {
      return el("tr", { "data-id": r.id },
        el("td", {}, latentLink(r.id)), el("td", {}, num("freq", r.freq, nTokens())), el("td", {}, num("max_act", r.max_act)),
        el("td", {}, num("mean_act", r.mean_act)), el("td", {}, num("dec_norm", r.dec_norm)),
        el("td", { class: "l", text: className(r.best_class) }),
        el("td", {}, num("best_ap", r.best_ap, r.best_ap === null ? "" : "95% interval [" + fmt(r.best_ap_lo) + ", " + fmt(r.best_ap_hi) + "]; " + nProbe(r.best_class))),
        el("td", {}, num("chance", r.best_class >= 0 ? chance(r.best_class) : null, probeN())));
    });
    const go = function (p) { return function () { t.page = p; rerender(); }; };
    const pager = el("div", { class: "pager" },
      el("button", { type: "button", "data-page": "prev", disabled: t.page === 0, onclick: go(t.page - 1), text: "◀ prev" }),
      el("span", { class: "range", text: "rows " + (total ? t.page * PAGE_ROWS + 1 : 0) + "–" + (t.page * PAGE_ROWS + ids.length) + " of " + total +
        (total < m.width ? " (filtered from " + m.width + ")" : "") }),
      el("button", { type: "button", "data-page": "next", disabled: t.page >= pages - 1, onclick: go(t.page + 1), text: "next ▶" }));
    status.textContent = "";
    app.append(pager, el("table", { class: "latents" }, el("thead", {}, head), el("tbody", {}, body)));
    document.body.dataset.table = [t.sort, t.desc ? "desc" : "asc", t.page, total].join(":");
    if (window.__explorerReady === undefined) window.__explorerReady = performance.now();
  }

  // ---- one latent's page ------------------------------------------------------------------
  function parseId(s, max, what) {
    const id = Number(s);
    if (s === "" || !Number.isInteger(id) || id < 0 || id >= max) throw new UserError("no " + what + " " + JSON.stringify(s) + ": ids run from 0 to " + (max - 1));
    return id;
  }
  function UserError(msg) { this.message = msg; }

  async function viewLatent(app, seq, arg) {
    const m = S.meta, id = parseId(arg, m.width, "latent");
    const dc = Math.floor(id / m.detail_chunk);
    const [r, d] = await Promise.all([row(id), detailChunk(dc)]);
    if (seq !== S.seq) return;
    const det = d.latents[id - d.start];
    const nav = el("p", { title: "the arrow keys step too" }, id > 0 ? stepLink(latentLink(id - 1, "◀ " + (id - 1)), "prev") : null, " ",
      id + 1 < m.width ? stepLink(latentLink(id + 1, (id + 1) + " ▶"), "next") : null);
    const stats = el("dl", { class: "stats" },
      el("dt", { title: def("freq"), text: "frequency" }), el("dd", {}, num("freq", r.freq, nTokens()), el("span", { class: "muted", text: " (" + nTokens() + ")" })),
      el("dt", { title: def("max_act"), text: "max activation" }), el("dd", {}, num("max_act", r.max_act)),
      el("dt", { title: def("mean_act"), text: "mean activation" }), el("dd", {}, num("mean_act", r.mean_act)),
      el("dt", { title: def("dec_norm"), text: "decoder norm" }), el("dd", {}, num("dec_norm", r.dec_norm)),
      el("dt", { title: def("best_class"), text: "best class" }), el("dd", { class: "best-class", text: className(r.best_class) }),
      el("dt", { title: def("best_ap"), text: "AP" }), el("dd", {}, num("best_ap", r.best_ap, r.best_ap === null ? "" : nProbe(r.best_class)),
        r.best_ap === null ? null : el("span", { class: "muted", text: " 95% [" + fmt(r.best_ap_lo) + ", " + fmt(r.best_ap_hi) + "], chance " }),
        r.best_ap === null ? null : num("chance", chance(r.best_class), probeN()),
        r.best_ap === null ? null : el("span", { class: "muted", text: ", " + probeN() })));
    const parts = [el("h2", { text: "Latent " + id }), nav, stats];
    parts.push(el("h3", { title: "the images with the largest activations; red: " + def("act") + " per patch, relative to the latent's max", text: "Top images" }));
    parts.push(det.top.length ? el("div", { class: "figs top" }, det.top.map(exampleFig)) : el("p", { class: "muted", text: "never fires in the pass" }));
    if (det.quantiles && det.quantiles.length) {
      parts.push(el("h3", { title: def("quantiles"), text: "Examples by activation" }));
      parts.push(el("div", { class: "bins" }, det.quantiles.flatMap(function (q) {
        return [el("span", { class: "bin", text: fmt(q.lo) + " – " + fmt(q.hi) }),
          q.examples.length ? el("div", { class: "figs" }, q.examples.map(exampleFig)) : el("span", { class: "muted", text: "no example in this bin" })];
      })));
    }
    const nh = det.hist.reduce(function (a, b) { return a + b; }, 0);
    parts.push(el("h3", { title: def("hist"), text: "Activation histogram (n = " + nh + " tokens)" }), histogram(det.hist, m.hist_edges));
    parts.push(el("h3", { title: def("neighbours") + "; " + def("cos"), text: "Nearest latents by decoder cosine" }),
      det.neighbours.length ? el("ul", { class: "neighbours" }, det.neighbours.map(function (nb) { return el("li", {}, latentLink(nb.id), " · cos ", num("cos", nb.cos)); }))
        : el("p", { class: "muted", text: "none" }));
    if (det.sweep_neighbours && det.sweep_neighbours.length) {
      const bySae = {};
      (m.sweep || []).forEach(function (s) { bySae[s.sae_id] = s; });
      parts.push(el("h3", { title: def("cos") + ", with the other SAEs of the sweep", text: "Nearest latents in the sweep's other SAEs" }),
        el("ul", { class: "sweep-neighbours" }, det.sweep_neighbours.map(function (nb) {
          const s = bySae[nb.sae_id];
          const label = (s ? s.title : nb.sae_id) + " · latent " + nb.id;
          return el("li", {}, s ? el("a", { href: s.href + "#latent=" + nb.id, text: label }) : el("span", { text: label }), " · cos ", num("cos", nb.cos));
        })));
    }
    show(app, ...parts);
  }

  // ---- images: browse, patch grid, patch -> latents -----------------------------------------
  function imageBrowser(current) {
    const m = S.meta, b = S.browse;
    const list = m.images.filter(function (im) { return b.cls === "" || String(im.label) === b.cls; });
    const pages = Math.max(1, Math.ceil(list.length / BROWSE_PAGE));
    b.page = Math.min(b.page, pages - 1);
    const shown = list.slice(b.page * BROWSE_PAGE, (b.page + 1) * BROWSE_PAGE);
    const sel = el("select", { "data-filter": "image-class", onchange: function (e) { b.cls = e.target.value; b.page = 0; route(); } },
      el("option", { value: "", text: "all classes" }),
      Object.keys(m.classes || {}).map(function (k) { return el("option", { value: k, text: className(k), selected: b.cls === k }); }));
    const idIn = el("input", { type: "number", min: 0, step: 1, placeholder: "image id", "data-filter": "image-id" });
    const form = el("form", { class: "controls", onsubmit: function (e) { e.preventDefault(); location.hash = "#image=" + idIn.value; } },
      el("label", {}, "class", sel), el("label", {}, "image id", idIn), el("button", { type: "submit", text: "open" }),
      el("button", { type: "button", disabled: b.page === 0, text: "◀", onclick: function () { b.page--; route(); } }),
      el("span", { text: list.length + " explorable images, page " + (b.page + 1) + " / " + pages }),
      el("button", { type: "button", disabled: b.page >= pages - 1, text: "▶", onclick: function () { b.page++; route(); } }));
    const figs = el("div", { class: "figs browse" }, shown.map(function (im) {
      return el("figure", {}, el("a", { href: "#image=" + im.id, class: im.id === current ? "sel" : null },
        el("div", { class: "thumb" }, im.file ? el("img", { src: im.file, alt: "image " + im.id }) : el("span", { text: String(im.id) }))),
        el("figcaption", { text: im.id + (im.label === null || im.label === undefined ? "" : " · " + className(im.label)) }));
    }));
    return el("details", { open: current === null }, el("summary", { text: "browse the explorable images" }), form, figs);
  }

  function latentList(ids, acts, cls, hrefBase) {
    if (!ids.length) return el("p", { class: "muted", text: "no latent fires here" });
    return el("table", { class: cls }, el("thead", {}, el("tr", {}, el("th", { title: def("id"), text: "latent" }), el("th", { title: def("act"), text: "act" }))),
      el("tbody", {}, ids.map(function (id, i) {
        const link = hrefBase === undefined ? latentLink(id) : el("a", { href: hrefBase + "#latent=" + id, class: "latent", "data-id": id, text: String(id) });
        return el("tr", { "data-id": id }, el("td", {}, link), el("td", {}, num("act", acts[i])));
      })));
  }

  async function viewImage(app, seq, arg, patchArg) {
    const m = S.meta;
    if (arg === "") { app.replaceChildren(el("h2", { text: "Images" }), imageBrowser(null)); return; }
    const id = Number(arg);
    if (!Number.isInteger(id) || !explorable(id)) throw new UserError("image " + JSON.stringify(arg) + " is not one of this explorer's " + m.images.length + " explorable images (browse them under \"images\")");
    const im = await imageChunk(id);
    if (seq !== S.seq) return;
    const g = m.grid, pot = m.patch_of_token, tokenOf = {};
    pot.forEach(function (p, t) { if (p >= 0) tokenOf[p] = t; });
    const idx = m.images.findIndex(function (x) { return x.id === id; });
    const patchPanel = el("div", { class: "patch-panel" });
    let pinned = patchArg === null ? null : Number(patchArg);
    if (pinned !== null && !(g && Number.isInteger(pinned) && pinned >= 0 && pinned < g * g)) throw new UserError("no patch " + JSON.stringify(patchArg) + ": patches run from 0 to " + (g * g - 1));
    const showPatch = function (p) {
      const t = tokenOf[p], pl = im.patches[t] || { ids: [], acts: [] };
      patchPanel.replaceChildren(el("h3", { title: def("patches") + "; " + def("act"),
        text: "Patch " + p + " (row " + Math.floor(p / g) + ", column " + (p % g) + ", token " + t + ")" }),
        latentList(pl.ids, pl.acts, "patch-latents"));
      patchPanel.dataset.patch = p;
    };
    const src = im.file || thumbSrc(id);
    const big = el("div", { class: "big" }, src ? el("img", { src: src, alt: "image " + id }) : null);
    const cells = [];
    if (g) {
      const box = el("div", { class: "cells", style: "grid-template-columns: repeat(" + g + ", 1fr)" });
      for (let p = 0; p < g * g; p++) {
        const cell = el("div", { class: "cell" + (p === pinned ? " sel" : ""), "data-patch": p, title: "patch " + p,
          onmouseenter: function () { showPatch(p); },
          onmouseleave: function () { if (pinned !== null) showPatch(pinned); },
          onclick: function () { history.replaceState(null, "", "#patch=" + id + "/" + p); pinned = p;
            cells.forEach(function (c, q) { c.classList.toggle("sel", q === p); }); showPatch(p); } });
        cells.push(cell); box.append(cell);
      }
      big.append(box);
    }
    if (pinned !== null) showPatch(pinned);
    else patchPanel.append(el("p", { class: "muted", text: g ? "hover or click a patch to list the latents firing there" : "this model has no patch grid" }));
    const other = [];
    pot.forEach(function (p, t) {
      if (p >= 0) return;
      const pl = im.patches[t] || { ids: [], acts: [] };
      other.push(el("h4", { text: "token " + t + " (not a patch: CLS or register)" }), latentList(pl.ids, pl.acts, "token-latents"));
    });
    const nav = el("p", {}, idx > 0 ? el("a", { href: "#image=" + m.images[idx - 1].id, "data-step": "prev", text: "◀ previous image" }) : null, " ",
      idx + 1 < m.images.length ? el("a", { href: "#image=" + m.images[idx + 1].id, "data-step": "next", text: "next image ▶" }) : null, " ",
      m.sweep && m.sweep.length ? el("a", { href: "#sweep=" + id, text: "this image in every SAE of the sweep" }) : null);
    show(app, el("h2", { text: "Image " + id + (im.label === null || im.label === undefined ? "" : " · " + className(im.label)) }), nav, imageBrowser(id),
      el("div", { class: "row" }, big, patchPanel,
        el("div", { class: "image-top" }, el("h3", { title: "the image's top latents by their max activation over its tokens; " + def("act"), text: "Top latents of the image" }),
          latentList(im.top.ids, im.top.acts, "image-latents"))),
      other.length ? el("div", { class: "other-tokens" }, other) : null);
  }

  // ---- sweep: one image in every SAE ------------------------------------------------------
  function dirOf(href) { const i = href.lastIndexOf("/"); return i < 0 ? "" : href.slice(0, i + 1); }

  async function viewSweep(app, seq, arg) {
    const m = S.meta;
    const id = arg === "" ? (m.images[0] || {}).id : Number(arg);
    if (!Number.isInteger(id) || !explorable(id)) throw new UserError("image " + JSON.stringify(arg) + " is not one of this explorer's explorable images");
    const saes = [{ sae_id: m.sae_id, title: m.title + " (this one)", href: "" }].concat(m.sweep || []);
    const links = el("ul", { class: "explorers" }, saes.map(function (s) { return el("li", {}, el("a", { href: s.href || "#", class: "explorer", text: s.title }), el("span", { class: "muted", text: " " + s.sae_id })); }));
    const cols = await Promise.all(saes.map(function (s) {
      const src = s.href ? dirOf(s.href) + "data/images/" + pad4(id) + ".js" : "data/images/" + pad4(id) + ".js";
      return chunk("sweep:" + s.href + ":" + id, src, false).then(function (v) { return { s: s, v: v }; }, function () { return { s: s, v: null }; });
    }));
    if (seq !== S.seq) return;
    const idx = m.images.findIndex(function (x) { return x.id === id; });
    const nav = el("p", {}, idx > 0 ? el("a", { href: "#sweep=" + m.images[idx - 1].id, "data-step": "prev", text: "◀ previous image" }) : null, " ",
      el("a", { href: "#image=" + id, text: "image " + id + " in this SAE" }), " ",
      idx + 1 < m.images.length ? el("a", { href: "#sweep=" + m.images[idx + 1].id, "data-step": "next", text: "next image ▶" }) : null);
    const row = el("div", { class: "sweep" }, cols.map(function (c) {
      return el("div", { class: "sweep-col", "data-sae": c.s.sae_id }, el("h3", {}, el("a", { href: c.s.href || "#", text: c.s.title })),
        c.v ? latentList(c.v.top.ids, c.v.top.acts, "image-latents", c.s.href) : el("p", { class: "muted", text: "this image is not among that SAE's explorable images" }));
    }));
    show(app, el("h2", { text: "Sweep: image " + id }), el("div", { class: "thumb" }, thumbSrc(id) ? el("img", { src: thumbSrc(id), alt: "image " + id }) : null), nav,
      el("h3", { text: "Every explorer of the sweep" }), links, el("h3", { title: def("act"), text: "Top latents of image " + id + " in each SAE" }), row);
  }

  // ---- classes: the best latents per class --------------------------------------------------
  async function viewClasses(app, seq) {
    const m = S.meta, status = el("p", { class: "muted" });
    app.replaceChildren(el("h2", { text: "Best latents per class" }), status);
    const c = await allColumns(status);
    if (seq !== S.seq) return;
    const best = {};
    for (let i = 0; i < m.width; i++) {
      const k = c.best_class[i];
      if (k < 0 || Number.isNaN(c.best_ap[i])) continue;
      (best[k] = best[k] || []).push(i);
    }
    const rows = Object.keys(m.classes || {}).map(function (k) {
      const ids = (best[k] || []).sort(function (a, b) { return c.best_ap[b] - c.best_ap[a] || a - b; }).slice(0, 5);
      return el("tr", { "data-class": k }, el("td", { class: "l", text: className(k) }), el("td", {}, num("chance", chance(k), "the class's prevalence among the probe's images (" + probeN() + ")")),
        el("td", { class: "l" }, ids.length ? ids.flatMap(function (i) { return [el("a", { href: "#latent=" + i, class: "latent best", "data-id": i, text: String(i) }), " (", num("best_ap", c.best_ap[i], nProbe(k)), ") "]; }) : "none"));
    });
    status.textContent = "";
    app.append(el("table", { class: "classes" }, el("thead", {}, el("tr", {}, el("th", { class: "l", text: "class" }),
      el("th", { title: "AP of a random ranking: the class's prevalence (" + probeN() + ")", text: "chance" }),
      el("th", { class: "l", title: "latents whose best class this is, by AP (at most 5); " + def("best_ap"), text: "best latents (AP)" }))), el("tbody", {}, rows)));
  }

  // ---- routing ----------------------------------------------------------------------------
  async function route() {
    const seq = ++S.seq, app = document.getElementById("app"), raw = location.hash.slice(1);
    let h = raw;
    try { h = decodeURIComponent(raw); } catch (e) { /* a stray "%": the hash as typed */ }
    const eq = h.indexOf("="), view = eq < 0 ? h : h.slice(0, eq), arg = eq < 0 ? "" : h.slice(eq + 1);
    try {
      if (view === "latent") await viewLatent(app, seq, arg);
      else if (view === "image") await viewImage(app, seq, arg, null);
      else if (view === "patch") { const p = arg.split("/"); await viewImage(app, seq, p[0], p.length > 1 ? p[1] : null); }
      else if (view === "sweep") await viewSweep(app, seq, arg);
      else if (view === "classes") await viewClasses(app, seq);
      else await viewTable(app, seq);
    } catch (e) {
      if (seq !== S.seq) return;
      if (e instanceof UserError) app.replaceChildren(el("p", { class: "error", text: e.message }));
      else { app.replaceChildren(el("p", { class: "error", text: "error: " + e.message })); console.error(e); }
    }
    if (seq === S.seq) { document.body.dataset.rendered = "#" + h; window.scrollTo(0, 0); }
  }

  // the arrow keys step to the previous / next latent (or image) where the view has such links
  function step(e) {
    if (e.altKey || e.ctrlKey || e.metaKey || /^(INPUT|SELECT|TEXTAREA)$/.test((e.target || {}).tagName || "")) return;
    const rel = e.key === "ArrowLeft" ? "prev" : e.key === "ArrowRight" ? "next" : null;
    const a = rel && document.querySelector("#app a[data-step=" + rel + "]");
    if (a) { e.preventDefault(); location.hash = a.getAttribute("href"); }
  }

  async function start() {
    try {
      S.meta = await own("meta", true);
    } catch (e) {
      document.getElementById("app").replaceChildren(el("p", { class: "error", text: "cannot load data/meta.js next to this page: open index.html inside its explorer folder (" + e.message + ")" }));
      console.error(e);
      return;
    }
    if (S.meta.format !== 1) console.error("explorer data format " + S.meta.format + ", this app reads format 1: re-run actcache visuals");
    document.getElementById("title").textContent = S.meta.title + " · " + S.meta.sae_id + " · " + S.meta.width + " latents";
    document.title = S.meta.title + " · explorer";
    if (S.meta.sweep && S.meta.sweep.length) document.getElementById("nav-sweep").hidden = false;
    document.getElementById("jump").addEventListener("submit", function (e) {
      e.preventDefault();
      const input = document.getElementById("jump-id");
      input.blur();  // the arrow keys then step through latents
      location.hash = "#latent=" + input.value;
    });
    window.addEventListener("hashchange", route);
    document.addEventListener("keydown", step);
    route();
  }
  start();
})();
