// grpolab view: curves as inline SVG and a step browser of per-token records. No dependencies.
// Every figure and text of a run goes into the DOM through esc() or textContent: a run's data is never markup.
"use strict";
window.addEventListener("error", (e) => {
  const p = document.createElement("p");
  p.className = "page-error";
  p.textContent = `grpolab view: this page failed to draw (${e.message})`;
  document.body.prepend(p);
});
const DATA = JSON.parse(document.getElementById("data").textContent);
const RUNS = DATA.runs;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
// a figure as text (not HTML: esc() it); anything not a finite number is shown as it is
const fmt = (v, d = 3) => (v == null ? "n/a" : typeof v !== "number" || !isFinite(v) ? String(v)
  : Math.abs(v) >= 1000 ? v.toFixed(0) : v.toFixed(d));
const finite = (p) => p[1] != null;

// the runs of points with a value (a null is a non-finite figure: a gap in the curve)
function segments(pts) {
  const out = [[]];
  for (const p of pts) {
    if (finite(p)) out[out.length - 1].push(p);
    else if (out[out.length - 1].length) out.push([]);
  }
  return out.filter((s) => s.length);
}
const SERIES_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
const RUN_DASHES = ["", "6 3", "2 2", "8 3 2 3"];

// ------------------------------------------------------------------ curves
const CHARTS = [
  ["reward and accuracy", ["train/reward", "eval/accuracy", "train/format_reward"]],
  ["KL", ["train/kl", "train/kl_to_ref", "train/approx_kl_old_new"]],
  ["entropy (nats per token)", ["train/token_entropy", "eval/mean_token_entropy"]],
  ["clip fraction", ["train/clip_fraction", "train/value_clip_fraction"]],
  ["response length (tokens)", ["train/response_length", "train/response_length_correct", "train/response_length_incorrect"]],
  ["health flags", ["health/zero_variance_group_fraction", "health/truncation_rate", "health/format_failure_rate",
                    "health/logprob_mismatch", "health/reward_errors", "health/nonfinite_steps"]],
];

function chart(title, keys) {
  const W = 300, H = 140, L = 38, R = 6, T = 6, B = 18;
  const lines = [];
  RUNS.forEach((run, ri) => keys.forEach((key, ki) => {
    if (run.curves[key] && run.curves[key].some(finite)) lines.push({ run: ri, key: ki, pts: run.curves[key] });
  }));
  const present = keys.filter((k) => RUNS.some((r) => r.curves[k] && r.curves[k].length));
  const box = document.createElement("div");
  box.className = "chart";
  box.innerHTML = `<h3>${esc(title)}</h3><div class="keys">${present.map((k) =>
    `<span style="color:${SERIES_COLORS[keys.indexOf(k)]}">&#9644; ${esc(k)}</span>`).join(" ")}</div>`;
  if (!lines.length) {
    const why = present.length ? "no finite values (see the notes above)" : "not in this run's metrics";
    box.insertAdjacentHTML("beforeend", `<div class="none">${why}</div>`);
    return box;
  }
  const xs = lines.flatMap((l) => l.pts.map((p) => p[0]));  // the gaps' steps too: the axis spans them
  const ys = lines.flatMap((l) => l.pts.filter(finite).map((p) => p[1]));
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(0, ...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" role="img" aria-label="${esc(title)}">`;
  svg += `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`;
  svg += `<text x="${L - 3}" y="${T + 8}" font-size="9" text-anchor="end">${esc(fmt(y1, 2))}</text>`;
  svg += `<text x="${L - 3}" y="${H - B}" font-size="9" text-anchor="end">${esc(fmt(y0, 2))}</text>`;
  svg += `<text x="${L}" y="${H - 4}" font-size="9">${esc(fmt(x0, 0))}</text>`;
  svg += `<text x="${W - R}" y="${H - 4}" font-size="9" text-anchor="end">${esc(RUNS[0].step_key)} ${esc(fmt(x1, 0))}</text>`;
  for (const l of lines) {
    const color = SERIES_COLORS[l.key], label = `${esc(RUNS[l.run].name)}: ${esc(keys[l.key])}`;
    const dot = (p) => `<circle cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="1.8" fill="${color}"/>`;
    for (const seg of segments(l.pts)) {  // a lone point between gaps is still drawn (as a dot)
      const d = seg.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      const dots = l.pts.length < 40 || seg.length === 1 ? seg.map(dot).join("") : "";
      svg += `<polyline fill="none" stroke="${color}" stroke-width="1.3" stroke-dasharray="${RUN_DASHES[l.run % 4]}"
        points="${d}"><title>${label}</title></polyline>${dots}`;
    }
  }
  box.insertAdjacentHTML("beforeend", svg + "</svg>");
  return box;
}

function drawNotes() {
  const notes = RUNS.flatMap((r) => (r.notes || []).map((n) => (RUNS.length > 1 ? `${r.name}: ${n}` : n)));
  for (const note of notes) $("notes").appendChild(document.createElement("p")).textContent = note;
  $("notes").hidden = !notes.length;
}

function drawOverview() {
  drawNotes();
  $("title").textContent = RUNS.map((r) => r.name).join(" vs ");
  $("runs-legend").innerHTML = RUNS.length > 1 ? RUNS.map((r, i) =>
    `<svg width="30" height="8"><line x1="0" y1="4" x2="30" y2="4" stroke="#333" stroke-width="2" stroke-dasharray="${RUN_DASHES[i % 4]}"/></svg> ${esc(r.name)} (${esc(r.path)})`).join(" &nbsp; ") : esc(RUNS[0].path);
  for (const [title, keys] of CHARTS) $("charts").appendChild(chart(title, keys));
  RUNS.forEach((r, i) => { $("config-run").add(new Option(r.name, i)); $("run").add(new Option(r.name, i)); });
  $("config-run").onchange = () => { $("config").textContent = RUNS[+$("config-run").value].config || "(no config.yaml)"; };
  $("config-run").onchange();
}

// ------------------------------------------------------------------ tokens
const MODES = {
  adv_ratio: { diverging: true, label: "advantage × ratio: green = pushed up, red = pushed down, white = no signal" },
  logprob: { label: "sampler log-prob: white = likely (p near 1), red = unlikely" },
  entropy: { label: "entropy of the policy at the token: white = certain, blue = uncertain" },
  gap: { diverging: true, label: "sampler − trainer log-prob: white = agree; green/red = sampler higher/lower" },
};
const at = (xs, i) => (xs == null ? null : Array.isArray(xs) ? xs[i] : xs);

function tokenValue(resp, i, mode) {
  if (mode === "adv_ratio") {
    const a = at(resp.advantage, i), r = at(resp.ratio, i);
    return a == null ? null : a * (r == null ? 1 : r);
  }
  if (mode === "logprob") return at(resp.sampler_lp, i);
  if (mode === "entropy") return at(resp.entropy, i);
  const s = at(resp.sampler_lp, i), t = at(resp.trainer_lp, i);
  return s == null || t == null ? null : s - t;
}

function mix(a, b, t) {
  t = Math.max(0, Math.min(1, t));
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * t)).join(",")})`;
}
const WHITE = [255, 255, 255], GREEN = [42, 157, 75], RED = [214, 39, 40], BLUE = [31, 119, 180];

function colorOf(v, mode, scale) {
  if (!Number.isFinite(v)) return null;  // not measured (or not a number)
  if (mode === "logprob") return mix(WHITE, RED, 1 - Math.exp(v));
  if (mode === "entropy") return mix(WHITE, BLUE, v / scale);
  return v >= 0 ? mix(WHITE, GREEN, v / scale) : mix(WHITE, RED, -v / scale);
}

const isCorrect = (r) => ("answer_reward" in (r.rewards || {}) ? r.rewards.answer_reward : r.reward) > 0.5;
const isZeroVariance = (g) => g.responses.every((r) => r.reward === g.responses[0].reward);

// the model's tokens just before an observation that open a tool tag: the call
function callTokens(resp) {
  const marks = new Set();
  if (!resp.obs) return marks;
  for (let s = 1; s < resp.tokens.length; s++) {
    if (!(resp.obs[s] && !resp.obs[s - 1])) continue;
    let text = "", i = s - 1;
    while (i >= 0 && !resp.obs[i]) { text = resp.tokens[i] + text; if (/<[a-z_]+>/.test(text)) break; i--; }
    if (i >= 0 && !resp.obs[i]) for (let j = i; j < s; j++) marks.add(j);
  }
  return marks;
}

function responseHtml(resp, g, ri, mode, scale) {
  const calls = callTokens(resp);
  let html = "", inObs = false;
  resp.tokens.forEach((tok, i) => {
    const obs = resp.obs && resp.obs[i];
    if (obs && !inObs) html += `<span class="obs-block">`;
    if (!obs && inObs) html += `</span>`;
    inObs = !!obs;
    const v = obs ? null : tokenValue(resp, i, mode), c = colorOf(v, mode, scale);
    const cls = "tok" + (c == null ? " na" : "") + (obs ? " obs" : "") + (calls.has(i) ? " call" : "");
    html += `<span class="${cls}" data-g="${g}" data-r="${ri}" data-i="${i}"${c ? ` style="background-color:${c}"` : ""}>${esc(tok)}</span>`;
  });
  if (inObs) html += "</span>";
  const adv = Array.isArray(resp.advantage) ? "per token (GAE)" : fmt(resp.advantage);
  const parts = Object.entries(resp.rewards || {}).filter(([k]) => k !== "reward")
    .map(([k, v]) => `${esc(k.replace(/_reward$/, ""))} ${esc(fmt(v, 2))}`);
  return `<div class="response ${isCorrect(resp) ? "correct" : "wrong"}" data-finish="${esc(resp.finish)}">
    <div class="response-head"><b>reward ${esc(fmt(resp.reward, 2))}</b> ${parts.join(", ")} · adv ${esc(adv)} · ${esc(resp.finish)} · ${resp.tokens.length} tok</div>
    <div class="tokens">${html}</div></div>`;
}

const PAGE = 8;  // groups drawn at once (a step recording many groups stays responsive)
const state = { run: 0, step: 0, shown: PAGE };
const current = () => RUNS[state.run].steps[state.step];

function drawSteps() {
  const run = RUNS[state.run], sel = $("step");
  sel.innerHTML = "";
  run.steps.forEach((s, i) => sel.add(new Option(`${s.step} (${s.groups.length} groups)`, i)));
  state.step = Math.min(state.step, Math.max(0, run.steps.length - 1));
  sel.value = state.step;
  drawGroups();
}

function drawGroups() {
  const run = RUNS[state.run], box = $("groups"), mode = $("color").value;
  if (!run.steps.length) {
    box.innerHTML = `<p class="empty">No per-token records in ${esc(run.path)} (tokens.jsonl is written by GRPO and PPO runs with token_record_groups &gt; 0).</p>`;
    $("legend").textContent = "";
    return;
  }
  const step = current(), fr = $("filter-response").value, fg = $("filter-group").value;
  const values = step.groups.flatMap((g) => g.responses.flatMap((r) => r.tokens.map((_, i) => tokenValue(r, i, mode))))
    .filter(Number.isFinite).map(Math.abs);
  const scale = values.reduce((a, b) => Math.max(a, b), 1e-6);  // (a spread of 100k+ values overflows the stack)
  const info = MODES[mode];
  $("legend").innerHTML = `<span class="bar" style="background:linear-gradient(to right, ${info.diverging ? `${mix(WHITE, RED, 1)}, #fff,` : "#fff,"} ${colorOf(mode === "logprob" ? -10 : scale, mode, scale)})"></span>
    ${esc(info.diverging ? `−${fmt(scale)} … +${fmt(scale)}` : mode === "entropy" ? `0 … ${fmt(scale)}` : "")} ${esc(info.label)}; dotted outline = not measured. ${esc(run.recorded_steps)} steps recorded.`;
  let html = "", matching = 0;
  step.groups.forEach((g, gi) => {
    const zero = isZeroVariance(g);
    if ((fg === "zero" && !zero) || (fg === "signal" && zero)) return;
    if (++matching > state.shown) return;
    const shown = g.responses.map((r, ri) => [r, ri]).filter(([r]) =>
      fr === "all" || (fr === "correct" && isCorrect(r)) || (fr === "wrong" && !isCorrect(r)) || (fr === "truncated" && r.finish === "length"));
    const mean = g.responses.reduce((s, r) => s + r.reward, 0) / g.responses.length;
    html += `<div class="group${zero ? " zero" : ""}" data-group="${esc(g.group)}">
      <div class="group-head">group ${esc(g.group)} · mean reward ${esc(fmt(mean, 2))}${zero ? " · <b>zero variance: no signal</b>" : ""}${g.answer != null ? ` · answer ${esc(g.answer)}` : ""}
      <div class="prompt">${esc(g.prompt)}</div></div>
      <div class="responses">${shown.map(([r, ri]) => responseHtml(r, gi, ri, mode, scale)).join("") || '<span class="empty">no response matches the filter</span>'}</div></div>`;
  });
  if (matching > state.shown) html += `<button id="more">show ${Math.min(PAGE, matching - state.shown)} more of ${matching - state.shown} groups</button>`;
  box.innerHTML = html || '<p class="empty">no group matches the filter</p>';
  if ($("more")) $("more").onclick = () => { state.shown += PAGE; drawGroups(); };
}

function showTip(ev) {
  const el = ev.target.closest(".tok"), tip = $("tip");
  if (!el) { tip.hidden = true; return; }
  const resp = current().groups[+el.dataset.g].responses[+el.dataset.r], i = +el.dataset.i;
  const s = at(resp.sampler_lp, i), t = at(resp.trainer_lp, i);
  tip.textContent = [
    `token     ${JSON.stringify(resp.tokens[i])}  (#${i})`,
    resp.obs && resp.obs[i] ? "observation (tool output: not trained)" : null,
    `sampler   log-prob ${fmt(s)}  p=${s == null ? "n/a" : fmt(Math.exp(s))}`,
    `trainer   log-prob ${fmt(t)}  gap ${s == null || t == null ? "n/a" : fmt(s - t, 4)}`,
    `advantage ${fmt(at(resp.advantage, i))}  ratio ${fmt(at(resp.ratio, i))}  clipped ${at(resp.clipped, i) == null ? "n/a" : at(resp.clipped, i) ? "yes" : "no"}`,
    `entropy   ${fmt(at(resp.entropy, i))}`,
  ].filter(Boolean).join("\n");
  tip.hidden = false;
  tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 4) + "px";
  tip.style.top = ev.clientY + 14 + "px";
}

function move(delta) {
  const n = RUNS[state.run].steps.length;
  if (!n) return;
  state.step = (state.step + delta + n) % n;
  state.shown = PAGE;
  $("step").value = state.step;
  drawGroups();
}

drawOverview();
$("run").onchange = () => { state.run = +$("run").value; drawSteps(); };
$("step").onchange = () => { state.step = +$("step").value; state.shown = PAGE; drawGroups(); };
$("prev").onclick = () => move(-1);
$("next").onclick = () => move(1);
for (const id of ["color", "filter-response", "filter-group"]) $(id).onchange = drawGroups;
$("groups").addEventListener("mouseover", showTip);
$("groups").addEventListener("mouseleave", () => { $("tip").hidden = true; });
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "SELECT") return;
  if (e.key === "ArrowLeft") move(-1);
  if (e.key === "ArrowRight") move(1);
});
drawSteps();
