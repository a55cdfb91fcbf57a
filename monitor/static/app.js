// The status page: polls /api/swarm once a second and /api/contributors (the ledger of verified
// work, when the monitor keeps one) every few seconds, and redraws. No library, no CDN: this file,
// index.html and style.css are everything, shipped in the package.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let updates = 0;

function text(id, value) { document.getElementById(id).textContent = value; }
function fmt(value, digits) { return value === null || value === undefined ? "-" : Number(value).toFixed(digits); }
function rate(value) { return value === null || value === undefined ? "-" : Math.round(value).toLocaleString("en"); }

function element(tag, attrs, content) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  if (content !== undefined) node.textContent = content;
  return node;
}

function drawStages(view) {
  const body = document.querySelector("#stages tbody");
  body.replaceChildren();
  for (const stage of view.stages) {
    const row = element("tr", {"data-stage": stage.stage, "data-workers": stage.workers.length});
    if (stage.stage === view.bottleneck_stage && view.stages.length > 1) row.classList.add("bottleneck");
    row.append(element("td", {}, `${stage.stage}`));
    const cell = element("td");
    if (stage.workers.length === 0) cell.append(element("span", {class: "empty"}, "no worker"));
    for (const worker of stage.workers) {
      const badge = element("span", {class: `worker phase-${worker.phase}`, "data-phase": worker.phase,
                                     title: `${worker.endpoint}, queue ${worker.queue_depth}`});
      badge.append(element("code", {}, worker.peer), document.createTextNode(` ${worker.phase}`));
      cell.append(badge);
    }
    row.append(cell);
    row.append(element("td", {class: "number"}, `${stage.step}`));
    row.append(element("td", {class: "number"}, rate(stage.throughput)));
    const success = stage.averaging_success;
    row.append(element("td", {}, stage.averaging_rounds
      ? `${stage.averaging_committed}/${stage.averaging_rounds} committed (${Math.round(100 * success)}%)`
      : "no rounds yet"));
    body.append(row);
  }
}

function drawChart(id, points, key, digits, empty = "no global batch yet") {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const width = 600, height = 220, left = 48, right = 10, top = 10, bottom = 24;
  svg.append(element("svg:line", {class: "axis", x1: left, y1: height - bottom, x2: width - right, y2: height - bottom}));
  svg.append(element("svg:line", {class: "axis", x1: left, y1: top, x2: left, y2: height - bottom}));
  if (points.length === 0) {
    svg.append(element("svg:text", {x: left + 10, y: height / 2}, empty));
    return;
  }
  const xs = points.map(p => p.step), ys = points.map(p => p[key]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const x = v => left + (width - left - right) * (v - x0) / (x1 - x0);
  const y = v => height - bottom - (height - top - bottom) * (v - y0) / (y1 - y0);
  svg.append(element("svg:polyline", {class: "curve", points: points.map(p => `${x(p.step)},${y(p[key])}`).join(" ")}));
  for (const p of points) svg.append(element("svg:circle", {class: "point", cx: x(p.step), cy: y(p[key]), r: 2.5,
                                                            "data-step": p.step, "data-value": p[key]}));
  svg.append(element("svg:text", {x: 2, y: top + 10}, fmt(y1, digits)));
  svg.append(element("svg:text", {x: 2, y: height - bottom}, fmt(y0, digits)));
  svg.append(element("svg:text", {x: left, y: height - 6}, `step ${x0}`));
  svg.append(element("svg:text", {x: width - right - 60, y: height - 6}, `step ${x1}`));
}

function draw(view) {
  text("run", view.run ? `run ${view.run}` : "");
  text("loss", fmt(view.loss, 4));
  text("tokens", rate(view.tokens_per_s));
  text("trainers", `${view.trainers.length}`);
  text("bottleneck", view.bottleneck_stage === null ? "-" : `${view.bottleneck_stage}`);
  text("drift", `${view.step_drift}`);
  text("targets", `${view.targets}`);
  drawStages(view);
  drawChart("loss-chart", view.history, "loss", 3);
  drawChart("rate-chart", view.history, "tokens_per_s", 0);
  drawChart("eval-chart", view.eval_history, "heldout_loss", 3, "no evaluation yet (the run config's evals)");
}

function when(seconds) { return new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19); }

function drawContributors(reply) {
  const body = document.querySelector("#contributors tbody");
  body.replaceChildren();
  for (const entry of reply.contributors) {
    const row = element("tr", {"data-worker": entry.worker, "data-tokens": entry.tokens});
    const short = entry.worker.length > 16 ? `${entry.worker.slice(0, 6)}...${entry.worker.slice(-6)}` : entry.worker;
    row.append(element("td", {title: entry.worker}, short), element("td", {}, entry.stages.join(", ")),
               element("td", {class: "number"}, rate(entry.tokens)),
               element("td", {class: "number"}, rate(entry.microbatches)),
               element("td", {class: "number"}, `${entry.receipts}`), element("td", {class: "number"},
               `${entry.trainers.length}`), element("td", {}, when(entry.first_seen)),
               element("td", {}, when(entry.last_seen)),
               element("td", {class: "number"}, entry.flagged_receipts
                 ? `${entry.flagged_receipts} (${rate(entry.flagged_tokens)} tokens)` : "-"));
    body.append(row);
  }
  text("ledger-status", reply.contributors.length
    ? `${reply.contributors.length} contributors, from trainers' signed receipts (export: /api/ledger)`
    : "no receipt yet");
}

async function refreshContributors() {
  try {
    const reply = await fetch("/api/contributors", {cache: "no-store"});
    if (reply.status === 404) { text("ledger-status", "this monitor keeps no ledger (--ledger FILE)"); return; }
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    drawContributors(await reply.json());
  } catch (error) {
    text("ledger-status", `cannot read the ledger: ${error}`);
  }
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("/api/swarm", {cache: "no-store"});
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    const view = await reply.json();
    draw(view);
    updates += 1;
    document.body.dataset.updates = `${updates}`;
    const workers = view.stages.reduce((n, s) => n + s.workers.length, 0);
    status.textContent = `${view.stages.length} stages, ${workers} workers; read from the DHT ` +
      `${fmt(view.updated_at, 1)} s after the monitor started`;
    status.classList.remove("stale");
  } catch (error) {
    status.textContent = `cannot reach the monitor: ${error}`;
    status.classList.add("stale");
  }
}

refresh();
setInterval(refresh, 1000);
refreshContributors();
setInterval(refreshContributors, 5000);
