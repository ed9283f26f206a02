// hetsched console: polls GET /api/summary every second and redraws the fleet summary (per region, cluster or
// SKU), the TPU pods, reservations, placements and the rebalancer; a group's nodes (GET /api/nodes, a page at a
// time) and a node's GPUs (GET /api/node) are asked only once opened, then refreshed with the summary. No
// framework, no build step; every string from the server goes in as text (textContent / SVG attributes), never
// as HTML.
"use strict";

const POLL_MS = 1000;
const GIB = 1024 ** 3;
const SVG_NS = "http://www.w3.org/2000/svg";

const PAGE = 100; // nodes per page of a group

// What tests and operators can read: how many states were drawn, the last problem, and how long the page
// took: to its first summary (ms since the navigation started) and to each drill-down after its click.
window.hetschedConsole = {
  refreshes: 0,
  lastError: null,
  firstRenderMs: null,
  summaryBytes: null,
  firstTiming: null, // what the server spent on that first summary (asking the services, folding)
  timings: { nodes: [], node: [] },
};

// The GPU states the server tells apart, in the order of the legend and of the stacked bars.
const STATES = [
  ["placed", "placed", "holds a replica (its owner's, if reserved)"],
  ["lent", "lent", "reserved by one tenant, holding a borrower's replica"],
  ["reserved_hard", "reserved (hard)", "reserved, no replica yet; never lent"],
  ["reserved_soft", "reserved (soft)", "reserved, no replica yet; may be lent"],
  ["free", "free", "neither placed nor reserved"],
  ["unavailable", "unavailable", "its node is lost"],
];
const LETTER = { p: "placed", l: "lent", h: "reserved_hard", s: "reserved_soft", f: "free", x: "unavailable" };
const STATE_LABEL = Object.fromEntries(STATES.map(([state, text]) => [state, text]));

// Where the operator is: the grouping shown, the group opened (its page) and the node opened.
const view = { by: "cluster", group: null, offset: 0, node: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

// One colour per allocation (a TP group, a TPU slice), the same in every view: a hash of its id.
function colour(allocationId) {
  let hash = 2166136261;
  for (let i = 0; i < allocationId.length; i++) {
    hash ^= allocationId.charCodeAt(i);
    hash = Math.imul(hash, 16777619);
  }
  // Murmur3's finaliser: ids that differ in one character land on hues far apart.
  hash = Math.imul(hash ^ (hash >>> 16), 0x85ebca6b);
  hash = Math.imul(hash ^ (hash >>> 13), 0xc2b2ae35);
  const hue = ((hash ^ (hash >>> 16)) >>> 0) % 360;
  return `hsl(${hue}, 62%, 48%)`;
}

function holderColour(allocations) {
  return allocations && allocations.length ? colour(allocations[0]) : null;
}

function gib(bytes) {
  return (bytes / GIB).toFixed(bytes >= 100 * GIB ? 0 : 1);
}

function fraction(value) {
  return value === null || value === undefined ? "-" : value.toFixed(2);
}

function bar(part, whole, fill) {
  const inner = el("div");
  inner.style.width = `${Math.max(0, Math.min(100, whole > 0 ? (100 * part) / whole : 0))}%`;
  if (fill) inner.style.background = fill;
  return el("div", { class: "bar" }, inner);
}

function label(state, allocationId) {
  const known = (state.allocations || state.labels || {})[allocationId];
  return known ? `${allocationId} (${known.tenant}, ${known.model}, TP ${known.tp ?? "-"})` : allocationId;
}

function replace(id, ...children) {
  const target = document.getElementById(id);
  target.replaceChildren(...children.filter(Boolean));
}

// -- the fleet summary: GPUs by state per region, cluster or SKU ----------------------------------------

function count(n) {
  return n.toLocaleString("en-US");
}

function tib(bytes) {
  return bytes >= 1024 * GIB ? `${(bytes / (1024 * GIB)).toFixed(1)} TiB` : `${gib(bytes)} GiB`;
}

// One bar, one segment per state (widths proportional to the GPUs in it).
function stacked(row) {
  const segments = STATES.filter(([state]) => row[state] > 0).map(([state, text]) => {
    const part = el("div", { class: `st-${state}`, title: `${text}: ${count(row[state])}` });
    part.style.width = `${(100 * row[state]) / Math.max(1, row.gpus)}%`;
    return part;
  });
  return el("div", { class: "stack" }, ...segments);
}

function renderLegend() {
  const items = STATES.map(([state, text, help]) =>
    el("span", { class: "item", "data-legend": state, title: help }, el("span", { class: `swatch st-${state}` }), text),
  );
  replace("legend", ...items);
}

function renderTotals(fleet) {
  const t = fleet.total;
  replace(
    "totals",
    el("b", { text: `${count(t.nodes)} nodes, ${count(t.gpus)} GPUs: ` }),
    `${count(t.placed)} placed, ${count(t.lent)} lent, ${count(t.reserved)} reserved ` +
      `(${count(t.reserved_hard)} hard, ${count(t.reserved_soft)} soft), ${count(t.free)} free, ` +
      `${count(t.unavailable)} unavailable · HBM ${tib(t.hbm_used_bytes)} of ${tib(t.hbm_total_bytes)} held · ` +
      `fill ${fraction(t.fill)} · `,
    el("span", { class: t.alerts ? "badge firing" : "badge ok", text: `${count(t.alerts)} alert(s)` }),
  );
}

function summaryRow(row) {
  const selected = view.group === row.key;
  return el(
    "tr",
    { class: selected ? "group selected" : "group", "data-group": row.key, tabindex: 0 },
    el("td", null, el("b", { text: row.key })),
    el("td", { class: "num", text: count(row.nodes) }),
    el("td", { class: "num", text: count(row.gpus) }),
    el("td", { class: "states" }, stacked(row)),
    el("td", { class: "num", "data-count": "placed", text: count(row.placed) }),
    el("td", { class: "num", "data-count": "lent", text: count(row.lent) }),
    el("td", {
      class: "num",
      "data-count": "reserved",
      text: `${count(row.reserved)}`,
      title: `${row.reserved_hard} hard, ${row.reserved_soft} soft`,
    }),
    el("td", { class: "num", "data-count": "free", text: count(row.free) }),
    el("td", { class: "num", text: `${tib(row.hbm_used_bytes)} / ${tib(row.hbm_total_bytes)}` }),
    el("td", { class: "fill", title: fraction(row.fill) }, bar(row.fill || 0, 1)),
    el("td", null, row.alerts ? el("span", { class: "badge firing", text: String(row.alerts) }) : "-"),
  );
}

function renderSummary(state) {
  const fleet = state.fleet;
  if (!fleet) {
    replace("summary", el("p", { class: "muted", text: "no answer from topology yet" }));
    return;
  }
  renderTotals(fleet);
  for (const button of document.querySelectorAll("[data-by]")) button.classList.toggle("on", button.dataset.by === view.by);
  const rows = fleet.groups[view.by].map(summaryRow);
  const heads = [view.by, "nodes", "GPUs", "GPU states", "placed", "lent", "reserved", "free", "HBM held", "fill", "alerts"];
  replace("summary", table(heads, rows));
  const alerts = fleet.alerts.map((a) =>
    el("li", null, el("a", { href: "#", "data-open-node": a.node, text: a.node }), `: ${a.what}`),
  );
  replace(
    "alerts",
    alerts.length
      ? el("div", null, el("h3", { text: `Alerts (${fleet.alerts_total})` }), el("ul", { class: "alerts" }, ...alerts))
      : null,
  );
}

// -- a group's nodes, a page at a time ------------------------------------------------------------------

function strip(letters) {
  return el(
    "span",
    { class: "strip", title: [...letters].map((l, i) => `gpu${i}: ${STATE_LABEL[LETTER[l]]}`).join("\n") },
    ...[...letters].map((l) => el("span", { class: `cell st-${LETTER[l]}` })),
  );
}

function renderGroup(page) {
  const section = document.getElementById("group-section");
  section.hidden = false;
  document.getElementById("group-title").textContent = `${view.by} ${page.key}: ${count(page.total)} nodes`;
  const last = Math.min(page.total, page.offset + page.nodes.length);
  replace(
    "group-pager",
    el("button", { type: "button", "data-page": "prev", disabled: page.offset === 0 }, "previous"),
    el("span", { class: "muted", text: `${count(page.offset + 1)}-${count(last)} of ${count(page.total)}` }),
    el("button", { type: "button", "data-page": "next", disabled: last >= page.total }, "next"),
    el("button", { type: "button", "data-close": "group" }, "close"),
  );
  const rows = page.nodes.map((node) =>
    el(
      "tr",
      { class: view.node === node.name ? "node-row selected" : "node-row", "data-node": node.name, tabindex: 0 },
      el("td", null, el("b", { text: node.name })),
      el("td", { text: node.rack }),
      el("td", { text: node.sku }),
      el("td", null, node.state === "up" ? "up" : el("span", { class: `badge ${node.state}`, text: node.state })),
      el("td", null, strip(node.gpu_states)),
      el("td", { class: "num", text: `${gib(node.hbm_used_bytes)} / ${gib(node.hbm_total_bytes)} GiB` }),
      el("td", { class: "muted", text: node.alerts.join("; ") || "-" }),
    ),
  );
  replace("group-nodes", table(["node", "rack", "SKU", "state", "GPUs", "HBM held", "alerts"], rows));
}

// -- one node: its GPUs by state, its replicas, its NVLink graph -----------------------------------------

function stateColour(state) {
  return getComputedStyle(document.documentElement).getPropertyValue(`--${state.replace("_", "-")}`).trim();
}

function renderDomain(domain, gpus, node) {
  const size = Math.min(150, 64 + 12 * domain.members.length); // a pair needs less room than eight
  const centre = size / 2;
  const radius = size / 2 - 14;
  const where = new Map();
  domain.members.forEach((member, i) => {
    const angle = (2 * Math.PI * i) / domain.members.length - Math.PI / 2;
    where.set(member, [centre + radius * Math.cos(angle), centre + radius * Math.sin(angle)]);
  });
  const multiNode = new Set(domain.members.map((m) => m.split("/")[0])).size > 1;
  const edges = domain.edges.map(([a, b, code]) => {
    const [x1, y1] = where.get(a);
    const [x2, y2] = where.get(b);
    const links = /^NV(\d+)$/.exec(code);
    const width = links ? Math.min(3, 0.6 + Number(links[1]) / 9) : 1;
    return svg(
      "line",
      { class: code === "fabric" ? "edge fabric" : "edge", x1, y1, x2, y2, "stroke-width": width.toFixed(2) },
      svg("title", { text: `${a} - ${b}: ${code}` }),
    );
  });
  const dots = domain.members.map((member) => {
    const [x, y] = where.get(member);
    const gpu = gpus.get(member);
    const allocations = gpu ? gpu.allocations : [];
    const [host, local] = member.split("/");
    const tip = `${member}\n${allocations.map((a) => label(node, a)).join("\n") || (gpu ? STATE_LABEL[gpu.state] : "another node")}`;
    // A GPU holding a replica in its TP group's colour; otherwise in its state's.
    const fill = holderColour(allocations) || (gpu ? stateColour(gpu.state) : "#ffffff");
    return svg(
      "g",
      { "data-accelerator": member, "data-allocations": allocations.join(" ") || null },
      svg("circle", { class: "gpu-dot", cx: x, cy: y, r: 9, fill }),
      svg("text", { x, y: y + 3, "text-anchor": "middle", text: multiNode ? host.replace(/^.*-/, "") : local.replace("gpu", "") }),
      svg("title", { text: tip }),
    );
  });
  return el(
    "div",
    { class: "card domain", "data-domain": domain.id },
    el("h3", { text: domain.id }),
    el("div", { class: "meta muted", text: `${domain.kind}, ${domain.members.length} GPUs` }),
    svg("svg", { width: size, height: size, viewBox: `0 0 ${size} ${size}`, role: "img", "aria-label": domain.id }, ...edges, ...dots),
  );
}

function renderNode(node) {
  document.getElementById("node-section").hidden = false;
  const title = document.getElementById("node-title");
  title.replaceChildren(
    `node ${node.name} `,
    el("span", { class: "muted", text: `${node.cluster}/${node.rack} · ${node.sku} · ${node.kind || "-"} · ${node.state}` }),
    " ",
    el("button", { type: "button", "data-close": "node" }, "close"),
  );
  const rows = node.gpus.map((gpu) => {
    const holders = gpu.allocations.map((a) => label(node, a));
    const reservation = gpu.reservation ? `reservation ${gpu.reservation.id} (${gpu.reservation.tenant}, ${gpu.reservation.policy})` : "";
    const lent = gpu.borrowers.length ? `lent to ${gpu.borrowers.join(", ")}` : "";
    const what = [STATE_LABEL[gpu.state], reservation, lent, ...holders].filter(Boolean).join("\n");
    const swatch = el("span", { class: "swatch holder" });
    const holder = holderColour(gpu.allocations);
    if (holder) swatch.style.background = holder;
    return el(
      "div",
      {
        class: "gpu",
        "data-accelerator": gpu.id,
        "data-state": gpu.state,
        "data-allocations": gpu.allocations.join(" ") || null,
        title: what,
      },
      el("span", { text: `gpu${gpu.index}` }),
      el("span", { class: `swatch st-${gpu.state}` }),
      bar(gpu.hbm_used_bytes, gpu.hbm_usable_bytes, stateColour(gpu.state)),
      el("span", { class: "figure", text: `${gib(gpu.hbm_used_bytes)}/${gib(gpu.hbm_usable_bytes)} GiB` }),
      el("span", { class: "what" }, holder ? swatch : null, STATE_LABEL[gpu.state], gpu.reservation ? ` · ${gpu.reservation.tenant}` : ""),
    );
  });
  const alerts = node.alerts.length ? el("div", { class: "errors", text: node.alerts.join("\n") }) : null;
  const legend = el(
    "div",
    { class: "legend" },
    ...STATES.map(([state, text]) => el("span", { class: "item" }, el("span", { class: `swatch st-${state}` }), text)),
  );
  const replicas = node.allocations.map((a) => {
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = colour(a);
    return el("li", { "data-allocation": a }, swatch, label(node, a));
  });
  const card = el(
    "div",
    { class: "card node-card", "data-node-detail": node.name },
    legend,
    alerts,
    ...rows,
    replicas.length ? el("ul", { class: "replicas" }, ...replicas) : el("p", { class: "muted", text: "no replica" }),
  );
  const gpus = new Map(node.gpus.map((gpu) => [gpu.id, gpu]));
  replace("node-detail", card, ...node.domains.map((d) => renderDomain(d, gpus, node)));
}

// -- TPU pods: a grid of chips (a 3-D pod as one grid per first-axis layer), slices coloured -------

function renderPods(state) {
  const cards = state.tpu_pods.map((pod) => {
    const held = new Map(pod.held.map((chip) => [chip.coord.join("."), chip]));
    const layers = pod.shape.length === 3 ? pod.shape[0] : 1;
    const [rows, cols] = pod.shape.length === 3 ? [pod.shape[1], pod.shape[2]] : [pod.shape[0], pod.shape[1] || 1];
    const cell = pod.shape.length === 3 ? 7 : 10;
    const gap = 8;
    const layerWidth = cols * cell;
    const fit = Math.max(1, Math.floor(480 / (layerWidth + gap)));
    const perLine = Math.ceil(layers / Math.ceil(layers / fit)); // rows of equal length: 8 layers as 4 + 4
    const width = Math.min(layers, perLine) * (layerWidth + gap);
    const height = Math.ceil(layers / perLine) * (rows * cell + gap + 10);
    const shapes = [];
    for (let layer = 0; layer < layers; layer++) {
      const ox = (layer % perLine) * (layerWidth + gap);
      const oy = Math.floor(layer / perLine) * (rows * cell + gap + 10) + 10;
      if (layers > 1) shapes.push(svg("text", { x: ox, y: oy - 2, text: `x=${layer}` }));
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < cols; c++) {
          const coord = layers > 1 ? [layer, r, c] : pod.shape.length === 1 ? [r] : [r, c];
          const chip = held.get(coord.join("."));
          const allocations = chip ? chip.allocations : [];
          shapes.push(
            svg(
              "rect",
              {
                class: "chip",
                x: ox + c * cell,
                y: oy + r * cell,
                width: cell,
                height: cell,
                fill: holderColour(allocations) || "#e4e8ef",
                "data-allocations": allocations.join(" ") || null,
              },
              chip ? svg("title", { text: `${chip.id}\n${allocations.map((a) => label(state, a)).join("\n")}` }) : null,
            ),
          );
        }
      }
    }
    const slices = new Set(pod.held.flatMap((chip) => chip.allocations)).size;
    return el(
      "div",
      { class: "card pod", "data-pod": pod.name },
      el("h3", { text: pod.name }),
      el("div", {
        class: "meta muted",
        text: `${pod.type} ${pod.shape.join("x")}, ${pod.chips} chips, ${pod.region} · ${pod.held.length} held, ${slices} slice(s)`,
      }),
      svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": pod.name }, ...shapes),
    );
  });
  replace("pods", ...cards);
}

// -- reservations -------------------------------------------------------------------------------

function table(headers, rows) {
  return el(
    "table",
    null,
    el("thead", null, el("tr", null, ...headers.map((h) => el("th", { text: h })))),
    el("tbody", null, ...rows),
  );
}

function renderReservations(state) {
  const report = state.reservations;
  if (!report) {
    replace("reservations", el("p", { class: "muted", text: "no answer from the reservation filler" }));
    return;
  }
  const summary = el("p", {
    text:
      `fill rate ${fraction(report.fill_rate)}: ${report.reserved} reserved, ${report.owner_used} used by owners, ` +
      `${report.lent} lent; idle $${report.idle_cost_usd_per_hour.toFixed(2)}/h`,
  });
  const rows = report.reservations.map((r) =>
    el(
      "tr",
      { "data-reservation": r.reservation_id },
      el("td", { text: r.reservation_id }),
      el("td", { text: r.tenant }),
      el("td", { text: r.policy }),
      el("td", { text: `${r.accelerators_count} ${r.sku || ""}` }),
      el("td", { text: `${r.owner_used}/${r.lent}/${r.idle}` }),
      el("td", { class: "fill", title: fraction(r.fill_rate) }, bar(r.fill_rate, 1)),
    ),
  );
  const tenants = Object.entries(report.by_tenant).map(([tenant, rate]) =>
    el("tr", null, el("td", { text: tenant }), el("td", { class: "fill", title: fraction(rate) }, bar(rate, 1))),
  );
  replace(
    "reservations",
    summary,
    rows.length ? table(["id", "tenant", "policy", "reserved", "used/lent/idle", "fill"], rows) : null,
    tenants.length ? table(["tenant", "fill rate"], tenants) : el("p", { class: "muted", text: "nothing reserved" }),
  );
}

// -- recent placements, with their explanations ---------------------------------------------------

function where(row) {
  if (row.tpu_slice) {
    const s = row.tpu_slice;
    return `${s.pod} slice ${s.shape.join("x")} at (${s.origin.join(",")})`;
  }
  return row.placements
    .map((p) => `${p.node}: ${p.accelerators.map((a) => a.split("/").pop()).join(",")}`)
    .join("; ");
}

function renderPlacements(state) {
  const items = state.placements.map((row) => {
    const status = row.released ? "released" : row.status;
    const head = el(
      "div",
      null,
      el("span", { class: `badge ${status}`, text: row.released ? `released (${row.released})` : row.status }),
      " ",
      el("b", { text: `${row.tenant} · ${row.model}` }),
      " ",
      el("span", { class: "muted", text: new Date(row.occurred_at).toLocaleTimeString() }),
    );
    const alloc = row.allocation_id
      ? el(
          "div",
          null,
          el("span", { class: "swatch", "data-colour": row.allocation_id }),
          el("code", { text: row.allocation_id }),
          ` ${row.sku || ""} TP ${row.tp ?? "-"}${row.pp > 1 ? ` PP ${row.pp}` : ""} — ${where(row)}`,
        )
      : null;
    const swatch = alloc && alloc.querySelector(".swatch");
    if (swatch) swatch.style.background = colour(row.allocation_id);
    const error = row.error ? el("div", { class: "muted", text: `${row.error.code}: ${row.error.message}` }) : null;
    const why = row.explanation.length
      ? el("ul", { class: "explanation" }, ...row.explanation.map((line) => el("li", { text: line })))
      : null;
    return el(
      "li",
      { "data-request": row.request_id, "data-allocation": row.allocation_id || null, "data-status": status },
      head,
      alloc,
      error,
      why,
    );
  });
  if (!items.length) items.push(el("li", { class: "muted", text: "no placement yet" }));
  replace("placements", ...items);
}

// -- the rebalancer -------------------------------------------------------------------------------

function renderRebalancer(state) {
  const status = state.rebalancer;
  if (!status) {
    replace("rebalancer", el("p", { class: "muted", text: "no answer from the rebalancer" }));
    return;
  }
  const detectors = status.detectors.map((d) =>
    el(
      "tr",
      { "data-detector": d.name },
      el("td", { text: d.name }),
      el("td", { text: `${d.above ? ">" : "<"}${d.threshold} for ${d.window_s}s` }),
      el("td", null, el("span", { class: `badge ${d.state}`, text: d.state })),
      el("td", { text: d.targets.map((t) => `${t.key} ${t.phase} ${t.value.toFixed(2)}`).join(", ") || "-" }),
    ),
  );
  const plans = status.plans.map((p) =>
    el(
      "tr",
      { "data-plan": p.plan_id },
      el("td", { text: p.plan_id }),
      el("td", { text: `${p.kind} ${p.state}` }),
      el("td", { text: p.target }),
      el("td", { text: `${p.steps.filter((s) => s.state === "done").length}/${p.steps.length}` }),
      el("td", { text: p.reason }),
    ),
  );
  const recent = status.recent
    .slice(0, 10)
    .map((a) =>
      el("tr", null, el("td", { text: new Date(a.at).toLocaleTimeString() }), el("td", { text: a.what })),
    );
  replace(
    "rebalancer",
    table(["detector", "threshold", "state", "targets"], detectors),
    plans.length ? table(["plan", "kind", "target", "steps", "reason"], plans) : el("p", { class: "muted", text: "no plan" }),
    recent.length ? table(["at", "action"], recent) : el("p", { class: "muted", text: "no action yet" }),
  );
}

// -- the loop -----------------------------------------------------------------------------------

function renderErrors(errors) {
  const box = document.getElementById("errors");
  const lines = Object.entries(errors).map(([part, why]) => `${part}: ${why}`);
  box.hidden = lines.length === 0;
  box.textContent = lines.join("\n");
}

function render(state) {
  renderErrors(state.errors);
  renderSummary(state);
  renderPods(state);
  renderReservations(state);
  renderPlacements(state);
  renderRebalancer(state);
  document.getElementById("updated").textContent = `updated ${new Date(state.generated_at).toLocaleTimeString()}`;
  document.getElementById("nats").textContent = state.nats_url || "";
}

class Unauthorised extends Error {}

async function ask(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (response.status === 401) throw new Unauthorised();
  const text = await response.text();
  const body = JSON.parse(text);
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return [body, text.length];
}

let lastSummary = null;

async function refreshGroup() {
  if (view.group === null) return;
  const query = new URLSearchParams({ by: view.by, key: view.group, offset: view.offset, limit: PAGE });
  const [page] = await ask(`/api/nodes?${query}`);
  renderGroup(page);
}

async function refreshNode() {
  if (view.node === null) return;
  const [node] = await ask(`/api/node?${new URLSearchParams({ name: view.node })}`);
  renderNode(node);
}

function failed(error) {
  if (error instanceof Unauthorised) {
    window.location.assign("/login"); // no session (the console restarted with a new token): log in again
    return;
  }
  window.hetschedConsole.lastError = String(error);
  renderErrors({ console: String(error) });
}

async function poll() {
  const started = Date.now();
  try {
    const [state, bytes] = await ask("/api/summary");
    lastSummary = state;
    render(state);
    if (window.hetschedConsole.firstRenderMs === null) {
      window.hetschedConsole.firstRenderMs = Math.round(performance.now());
      window.hetschedConsole.summaryBytes = bytes;
      window.hetschedConsole.firstTiming = state.timing || null;
    }
    await refreshGroup();
    await refreshNode();
    window.hetschedConsole.lastError = null;
  } catch (error) {
    failed(error);
  } finally {
    window.hetschedConsole.refreshes += 1;
    document.body.dataset.refreshes = String(window.hetschedConsole.refreshes);
    setTimeout(poll, Math.max(0, POLL_MS - (Date.now() - started)));
  }
}

// A drill-down asked now (not at the next poll); its time from the click to the drawing is kept.
async function drill(what, refresh, undo) {
  const started = performance.now();
  try {
    await refresh();
    window.hetschedConsole.timings[what].push(Math.round(performance.now() - started));
    return true;
  } catch (error) {
    if (undo) undo(); // a name not in the fleet: say so once, do not ask again at every poll
    failed(error);
    return false;
  }
}

function openGroup(key) {
  view.group = key;
  view.offset = 0;
  if (lastSummary) renderSummary(lastSummary);
  drill("nodes", refreshGroup, () => (view.group = null)).then((ok) => {
    if (ok) document.getElementById("group-section").scrollIntoView({ block: "nearest" });
  });
}

function openNode(name) {
  view.node = name;
  drill("node", refreshNode, () => (view.node = null)).then((ok) => {
    if (ok) document.getElementById("node-section").scrollIntoView({ block: "nearest" });
  });
}

function activate(event, handler) {
  if (event.type === "keydown" && event.key !== "Enter") return;
  handler();
}

function wire() {
  renderLegend();
  for (const button of document.querySelectorAll("[data-by]")) {
    button.addEventListener("click", () => {
      view.by = button.dataset.by;
      view.group = null;
      document.getElementById("group-section").hidden = true;
      if (lastSummary) renderSummary(lastSummary);
    });
  }
  for (const type of ["click", "keydown"]) {
    document.getElementById("summary").addEventListener(type, (event) => {
      const row = event.target.closest("tr[data-group]");
      if (row) activate(event, () => openGroup(row.dataset.group));
    });
    document.getElementById("group-nodes").addEventListener(type, (event) => {
      const row = event.target.closest("tr[data-node]");
      if (row) activate(event, () => openNode(row.dataset.node));
    });
  }
  document.getElementById("alerts").addEventListener("click", (event) => {
    const link = event.target.closest("[data-open-node]");
    if (!link) return;
    event.preventDefault();
    openNode(link.dataset.openNode);
  });
  document.getElementById("group-pager").addEventListener("click", (event) => {
    const button = event.target.closest("button");
    if (!button) return;
    if (button.dataset.close) {
      view.group = null;
      document.getElementById("group-section").hidden = true;
      if (lastSummary) renderSummary(lastSummary);
      return;
    }
    view.offset = Math.max(0, view.offset + (button.dataset.page === "next" ? PAGE : -PAGE));
    drill("nodes", refreshGroup);
  });
  document.getElementById("node-title").addEventListener("click", (event) => {
    if (!event.target.closest("[data-close]")) return;
    view.node = null;
    document.getElementById("node-section").hidden = true;
  });
  document.getElementById("find-node").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = new FormData(event.target).get("node").trim();
    if (name) openNode(name);
  });
}

wire();
poll();
