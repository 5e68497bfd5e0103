// jaxagent view: learning curves and the episode store of one or more runs.
// Plain browser JavaScript, no dependencies. Data arrive by <script> tags (so the page
// works from file://): data/runs.js calls JAXAGENT.setRuns(runs), and
// data/<run>/iter_<n>.js calls JAXAGENT.loaded(run, n, episodes) when an iteration is opened.
"use strict";
window.JAXAGENT = (() => {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  const SIGNALS = {
    advantage: "advantage",
    logp: "trainer log-prob",
    rollout_logp: "sampler log-prob",
    ratio: "IS ratio (trainer / sampler)",
    entropy: "entropy",
  };
  // [title, metric key, summary key before RL, summary key after RL]
  const CHARTS = [
    ["training success", "success_rate"],
    ["held-out success, sampled", "eval_success_rate", "success_before_rl", "success_after_rl"],
    ["held-out success, greedy", "eval_greedy_success_rate", "success_before_rl_greedy", "success_after_rl_greedy"],
    ["reward", "reward_mean"],
    ["entropy", "entropy"],
    ["approx KL", "approx_kl"],
    ["clip fraction", "clipfrac"],
    ["groups without reward variance", "flat_groups_frac"],
    ["turns with a repeated anchor state", "anchor_repeat_frac"],
    ["invalid actions", "invalid_action_frac"],
    ["no-op actions", "noop_action_frac"],
    ["held-out no-op actions, greedy", "eval_greedy_noop_action_frac", "eval_before_rl_greedy.noop_action_frac",
     "eval_after_rl_greedy.noop_action_frac"],
    ["failed episodes", "failed_frac"],
    ["collapse warnings (total)", "collapse_warnings"],
  ];
  const state = { runs: [], cache: {}, waiting: {}, panes: [] };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }
  const svg = (tag, attrs) => {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  };
  const fmt = (v, d = 3) => (v === null || v === undefined ? "-" : typeof v === "number" ? +v.toFixed(d) + "" : String(v));
  const isNum = (v) => typeof v === "number" && isFinite(v);
  const color = (k) => COLORS[k % COLORS.length];

  // ------------------------------------------------------------------ data
  function setRuns(runs) {
    state.runs = runs;
    render();
  }

  function loaded(runId, iteration, episodes) {
    const key = runId + "/" + iteration;
    state.cache[key] = episodes;
    for (const cb of state.waiting[key] || []) cb(episodes);
    delete state.waiting[key];
  }

  function loadIteration(runId, iteration, cb) {
    const key = runId + "/" + iteration;
    if (state.cache[key]) return cb(state.cache[key]);
    const first = !state.waiting[key];
    (state.waiting[key] = state.waiting[key] || []).push(cb);
    if (!first) return;
    const script = el("script", { src: `data/${runId}/iter_${iteration}.js` });
    script.onerror = () => {
      for (const f of state.waiting[key] || []) f(null);
      delete state.waiting[key];
    };
    document.body.append(script);
  }

  // ------------------------------------------------------------------ curves
  function seriesOf(run, key, before, after) {
    const pts = [];
    for (const m of run.metrics) if (isNum(m[key]) && isNum(m.iteration)) pts.push([m.iteration, m[key]]);
    const s = run.summary || {};
    if (before && isNum(s[before])) pts.unshift([0, s[before]]);
    if (after && isNum(s[after])) {
      const last = isNum(s.iterations_at_eval) ? s.iterations_at_eval
        : Math.max(0, ...run.metrics.map((m) => m.iteration).filter(isNum));
      if (!pts.some((p) => p[0] === last)) pts.push([last, s[after]]);
    }
    return pts;
  }

  function chart(title, series) {
    const W = 300, H = 150, L = 38, R = 8, T = 8, B = 20;
    const all = series.flatMap((s) => s.pts);
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const py = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
    root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
    root.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" }));
    for (const [v, y] of [[y0, H - B], [y1, T + 8]]) {
      const t = svg("text", { x: L - 3, y, "text-anchor": "end", "font-size": 10 });
      t.textContent = fmt(v, 3);
      root.append(t);
    }
    for (const [v, x, a] of [[x0, L, "start"], [x1, W - R, "end"]]) {
      const t = svg("text", { x, y: H - 6, "text-anchor": a, "font-size": 10 });
      t.textContent = fmt(v, 0);
      root.append(t);
    }
    for (const s of series) {
      if (s.pts.length > 1) {
        root.append(svg("polyline", {
          points: s.pts.map((p) => `${px(p[0])},${py(p[1])}`).join(" "),
          fill: "none", stroke: s.color, "stroke-width": 1.5,
        }));
      }
      if (s.markers || s.pts.length === 1) {
        for (const p of s.pts) {
          const c = svg("circle", { cx: px(p[0]), cy: py(p[1]), r: 3, fill: s.color, class: "point" });
          const tip = svg("title", {});
          tip.textContent = `${s.name}: iteration ${p[0]}, ${fmt(p[1], 4)}`;
          c.append(tip);
          root.append(c);
        }
      }
    }
    return el("div", { class: "chart", "data-title": title }, el("h3", {}, title), root);
  }

  function renderCurves() {
    const box = document.getElementById("curves");
    box.replaceChildren();
    for (const [title, key, before, after] of CHARTS) {
      const series = state.runs.map((run, k) => ({
        name: run.name, color: color(k), pts: seriesOf(run, key, before, after), markers: key.startsWith("eval_"),
      })).filter((s) => s.pts.length);
      if (series.length) box.append(chart(title, series));
    }
    if (!box.children.length) {
      box.append(el("p", { class: "empty" }, "no metrics yet"));
      return;
    }
    // any other numeric metric (the monitors of an env or a recipe, phase times ...), chosen here
    const shown = new Set(CHARTS.map((c) => c[1]));
    const keys = [...new Set(state.runs.flatMap((r) => r.metrics.flatMap((m) => Object.keys(m)
      .filter((k) => isNum(m[k]) && k !== "iteration" && !shown.has(k)))))].sort();
    if (!keys.length) return;
    const holder = el("div", { class: "chart-any" });
    const pick = el("select", { class: "metric-select" }, keys.map((k) => el("option", { value: k }, k)));
    const draw = () => {
      const key = pick.value;
      const series = state.runs.map((run, k) => ({
        name: run.name, color: color(k), pts: seriesOf(run, key), markers: key.startsWith("eval_"),
      })).filter((s) => s.pts.length);
      holder.replaceChildren(chart(key, series));
    };
    pick.addEventListener("change", draw);
    box.append(el("div", { class: "chart any" }, el("h3", {}, "any metric: ", pick), holder));
    draw();
  }

  // ------------------------------------------------------------------ colouring
  function scaleOf(signal, values) {
    const v = values.filter(isNum);
    if (!v.length) return 1;
    if (signal === "ratio") return Math.max(1e-6, ...v.map((x) => Math.abs(Math.log(Math.max(x, 1e-12)))));
    if (signal === "logp" || signal === "rollout_logp") return Math.max(1e-6, ...v.map((x) => -x));
    return Math.max(1e-6, ...v.map(Math.abs));
  }

  // diverging (blue - white - red) for advantage and the ratio; white to red for
  // surprise (-log-prob) and entropy
  function background(signal, v, scale) {
    if (!isNum(v)) return "#eee";
    let t;
    if (signal === "advantage") t = v / scale;
    else if (signal === "ratio") t = Math.log(Math.max(v, 1e-12)) / scale;
    else if (signal === "logp" || signal === "rollout_logp") t = -v / scale;
    else t = v / scale;
    t = Math.max(-1, Math.min(1, t));
    const mix = (a, b) => Math.round(255 + (a - 255) * Math.abs(t));
    return t >= 0 ? `rgb(${mix(220)},${mix(50)},${mix(40)})` : `rgb(${mix(40)},${mix(90)},${mix(220)})`;
  }

  function showTip(event, text) {
    const tip = document.getElementById("tooltip");
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = event.clientX + 12 + "px";
    tip.style.top = event.clientY + 12 + "px";
  }
  const hideTip = () => { document.getElementById("tooltip").hidden = true; };

  // ------------------------------------------------------------------ an episode
  function renderEpisode(pane, rec) {
    const box = pane.episodeBox;
    box.replaceChildren();
    if (!rec) return;
    const signal = pane.signal;
    const policy = rec.segments.filter((s) => s.kind === "policy");
    const scale = scaleOf(signal, policy.flatMap((s) => s[signal] || []));
    box.append(el("h3", {}, `episode ${rec.index} (iteration ${rec.iteration}, seed ${fmt(rec.seed)}, group ${rec.group_id})`));
    box.append(el("div", { class: "muted" },
      `return ${fmt(rec.return)} | success ${rec.success} | ${rec.rewards.length} turns | end: ${rec.end_reason || "-"}` +
      ` | invalid actions ${rec.invalid_actions} | no-op actions ${rec.noop_actions} | stored as: ${rec.why}`));
    box.append(el("div", { class: "scale" }, `${SIGNALS[signal]}: `,
      el("span", { class: "bar" }), signal === "ratio" ? `log ratio ±${fmt(scale)}`
        : signal === "advantage" ? `±${fmt(scale)}` : `0 … ${fmt(scale)}${signal.endsWith("logp") ? " (−log-prob)" : ""}`));
    if (rec.failure) box.append(el("div", { class: "info failure" }, "failure: " + rec.failure));
    for (const seg of rec.segments) {
      if (seg.kind !== "policy") {
        box.append(el("div", { class: "segment " + seg.kind }, seg.text));
        continue;
      }
      const reward = rec.rewards[seg.turn];
      box.append(el("div", { class: "turn-head" }, `turn ${seg.turn + 1} · reward ${fmt(reward)}`));
      const line = el("div", { class: "segment policy", "data-turn": seg.turn });
      seg.tokens.forEach((tok, j) => {
        const value = seg[signal] ? seg[signal][j] : null;
        const masked = seg.loss_mask && seg.loss_mask[j] === 0;
        const tipText = [`token ${JSON.stringify(seg.pieces[j])} (id ${tok})`]
          .concat(Object.keys(SIGNALS).filter((k) => seg[k]).map((k) => `${k.padEnd(12)} ${fmt(seg[k][j], 5)}`))
          .concat(masked ? ["not trained on (loss mask 0)"] : []).join("\n");
        line.append(el("span", {
          class: "tok" + (masked ? " masked" : ""), "data-token": tok, "data-value": value === null ? "" : value,
          style: `background: ${background(signal, value, scale)}`,
          onmousemove: (e) => showTip(e, tipText), onmouseleave: hideTip,
        }, seg.pieces[j]));
      });
      box.append(line);
    }
    if (rec.info && Object.keys(rec.info).length) {
      box.append(el("h3", {}, "final info"), el("div", { class: "info" }, JSON.stringify(rec.info, null, 2)));
    }
  }

  // ------------------------------------------------------------------ a pane
  function passes(d, f) {
    if (f.failed && !d.failed) return false;
    if (f.truncated && !d.truncated) return false;
    if (f.invalid && !(d.invalid_actions > 0)) return false;
    if (isNum(f.min) && !(d.return >= f.min)) return false;
    if (isNum(f.max) && !(d.return <= f.max)) return false;
    return true;
  }

  function renderList(pane) {
    const run = state.runs[pane.run];
    const rows = (run.iterations[pane.iteration] || []).filter((d) => passes(d, pane.filters));
    pane.listBox.replaceChildren();
    if (!rows.length) {
      pane.listBox.append(el("p", { class: "empty" }, "no stored episode of this iteration passes the filters"));
      return;
    }
    const table = el("table", { class: "episodes" },
      el("tr", {}, ["episode", "seed", "group", "return", "success", "turns", "end", "invalid", "stored as"].map((h) => el("th", {}, h))));
    for (const d of rows) {
      const tr = el("tr", {
        class: "episode-row" + (pane.selected === d.index ? " selected" : ""), "data-index": d.index,
        onclick: () => openEpisode(pane, d.index),
      }, [d.index, fmt(d.seed), d.group_id, fmt(d.return), d.success, d.turns, d.failed ? "failed" : d.end_reason,
        d.invalid_actions, d.why].map((c) => el("td", {}, c)));
      table.append(tr);
    }
    pane.listBox.append(table);
  }

  function openEpisode(pane, index) {
    pane.selected = index;
    renderList(pane);
    const run = state.runs[pane.run];
    loadIteration(run.id, pane.iteration, (episodes) => {
      if (episodes === null) {
        pane.episodeBox.replaceChildren(el("p", { class: "empty" }, `could not load data/${run.id}/iter_${pane.iteration}.js`));
        return;
      }
      renderEpisode(pane, episodes.find((e) => e.index === index));
    });
  }

  function buildPane(k) {
    const pane = { k, run: Math.min(k, state.runs.length - 1), iteration: null, signal: "advantage",
                   filters: {}, selected: null };
    const root = el("div", { class: "pane", id: `pane${k}` });
    const runSel = el("select", { class: "run-select" }, state.runs.map((r, i) => el("option", { value: i }, r.name)));
    const iterSel = el("select", { class: "iteration-select" });
    const sigSel = el("select", { class: "signal-select" },
      Object.entries(SIGNALS).map(([v, label]) => el("option", { value: v }, label)));
    const num = (name) => el("input", { type: "number", step: "any", class: `filter-${name}`,
      oninput: (e) => { pane.filters[name] = e.target.value === "" ? null : +e.target.value; renderList(pane); } });
    const box = (name, label) => el("label", {}, el("input", { type: "checkbox", class: `filter-${name}`,
      onchange: (e) => { pane.filters[name] = e.target.checked; renderList(pane); } }), " " + label);
    runSel.value = pane.run;
    const fillIterations = () => {
      const its = Object.keys(state.runs[pane.run].iterations).map(Number).sort((a, b) => a - b);
      iterSel.replaceChildren(...its.map((i) => el("option", { value: i }, `iteration ${i}`)));
      pane.iteration = its.length ? its[its.length - 1] : null;
      if (pane.iteration !== null) iterSel.value = pane.iteration;
    };
    const showList = () => {
      if (pane.iteration === null) {
        pane.listBox.replaceChildren(el("p", { class: "empty" }, "this run has no episode store (yet)"));
      } else renderList(pane);
    };
    runSel.addEventListener("change", () => {
      pane.run = +runSel.value; pane.selected = null; fillIterations(); showList(); renderEpisode(pane, null);
    });
    iterSel.addEventListener("change", () => {
      pane.iteration = +iterSel.value; pane.selected = null; renderList(pane); renderEpisode(pane, null);
    });
    sigSel.addEventListener("change", () => {
      pane.signal = sigSel.value;
      if (pane.selected !== null) openEpisode(pane, pane.selected);
    });
    root.append(el("div", { class: "controls" },
      el("label", {}, "run ", runSel), el("label", {}, iterSel), el("label", {}, "colour by ", sigSel)));
    root.append(el("div", { class: "controls" }, box("failed", "failed"), box("truncated", "truncated"),
      box("invalid", "invalid actions"), el("label", {}, "return ≥ ", num("min")), el("label", {}, "≤ ", num("max"))));
    pane.listBox = el("div", { class: "episode-list" });
    pane.episodeBox = el("div", { class: "episode" });
    root.append(pane.listBox, pane.episodeBox);
    fillIterations();
    showList();
    return [pane, root];
  }

  function render() {
    const chips = document.getElementById("run-list");
    chips.replaceChildren(...state.runs.map((r, k) => {
      // a code sandbox that ran with less than bubblewrap's isolation (accepted in the config)
      const iso = (r.summary || {}).sandbox_isolation;
      const weak = iso && iso !== "bwrap"
        ? [el("span", { class: "sandbox-warning", title: "the env's code sandbox did not isolate the file system" },
              ` sandbox: ${iso}, not isolated`)]
        : [];
      return el("span", { class: "run-chip", style: `border-color: ${color(k)}` }, [r.name, ...weak]);
    }));
    renderCurves();
    const panes = document.getElementById("panes");
    panes.replaceChildren();
    state.panes = [];
    for (const k of [0, 1]) {
      const [pane, root] = buildPane(k);
      state.panes.push(pane);
      panes.append(root);
    }
  }

  return { setRuns, loaded, state, openEpisode };
})();
