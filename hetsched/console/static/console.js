// hetsched console: polls GET /api/state every second and redraws. No framework, no build step; every
// string from the server goes in as text (textContent / SVG attributes), never as HTML.
"use strict";

const POLL_MS = 1000;
const GIB = 1024 ** 3;
const SVG_NS = "http://www.w3.org/2000/svg";

// What tests and operators can read: how many states were drawn, and the last problem.
window.hetschedConsole = { refreshes: 0, lastError: null };

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
  const known = state.allocations[allocationId];
  return known ? `${allocationId} (${known.tenant}, ${known.model}, TP ${known.tp ?? "-"})` : allocationId;
}

function replace(id, ...children) {
  const target = document.getElementById(id);
  target.replaceChildren(...children.filter(Boolean));
}

// -- nodes: per-GPU HBM bars --------------------------------------------------------------------

function renderNodes(state) {
  const cards = state.nodes.map((node) => {
    const rows = node.gpus.map((gpu) => {
      const holders = gpu.allocations.map((a) => label(state, a)).join("\n");
      return el(
        "div",
        {
          class: "gpu",
          "data-accelerator": gpu.id,
          "data-allocations": gpu.allocations.join(" ") || null,
          title: holders || "idle",
        },
        el("span", { text: `gpu${gpu.index}` }),
        bar(gpu.hbm_reserved_bytes, gpu.hbm_usable_bytes, holderColour(gpu.allocations)),
        el("span", { class: "figure", text: `${gib(gpu.hbm_reserved_bytes)}/${gib(gpu.hbm_usable_bytes)} GiB` }),
      );
    });
    const meta = `${node.region}/${node.cluster}/${node.rack} · ${node.sku} · ${node.kind || "-"}`;
    const state_ = node.state === "up" ? null : el("span", { class: `badge ${node.state}`, text: node.state });
    return el(
      "div",
      { class: `card node ${node.state}`, "data-node": node.name },
      el("h3", { text: node.name }, " ", state_),
      el("div", { class: "meta", text: meta, title: meta }),
      ...rows,
    );
  });
  replace("nodes", ...cards);
}

// -- NVLink domains: GPUs as graph nodes, NVLink edges from the node profiles -------------------

function renderDomains(state) {
  const gpus = new Map();
  for (const node of state.nodes) for (const gpu of node.gpus) gpus.set(gpu.id, gpu);
  const cards = state.domains.map((domain) => {
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
      const tip = `${member}\n${allocations.map((a) => label(state, a)).join("\n") || "idle"}`;
      return svg(
        "g",
        { "data-accelerator": member, "data-allocations": allocations.join(" ") || null },
        svg("circle", { class: "gpu-dot", cx: x, cy: y, r: 9, fill: holderColour(allocations) || "#e4e8ef" }),
        svg("text", {
          x,
          y: y + 3,
          "text-anchor": "middle",
          text: multiNode ? host.replace(/^.*-/, "") : local.replace("gpu", ""),
        }),
        svg("title", { text: tip }),
      );
    });
    const picture = svg(
      "svg",
      { width: size, height: size, viewBox: `0 0 ${size} ${size}`, role: "img", "aria-label": domain.id },
      ...edges,
      ...dots,
    );
    return el(
      "div",
      { class: "card domain", "data-domain": domain.id },
      el("h3", { text: domain.id }),
      el("div", { class: "meta muted", text: `${domain.kind}, ${domain.members.length} GPUs` }),
      picture,
    );
  });
  replace("domains", ...cards);
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
      el("td", { text: `${r.accelerators.length} ${r.sku || ""}` }),
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
  renderNodes(state);
  renderDomains(state);
  renderPods(state);
  renderReservations(state);
  renderPlacements(state);
  renderRebalancer(state);
  document.getElementById("updated").textContent = `updated ${new Date(state.generated_at).toLocaleTimeString()}`;
  document.getElementById("nats").textContent = state.nats_url || "";
}

async function poll() {
  const started = Date.now();
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (response.status === 401) {  // no session (the console restarted with a new token): log in again
      window.location.assign("/login");
      return;
    }
    const state = await response.json();
    if (!response.ok) throw new Error(state.error || `HTTP ${response.status}`);
    render(state);
    window.hetschedConsole.lastError = null;
  } catch (error) {
    window.hetschedConsole.lastError = String(error);
    renderErrors({ console: String(error) });
  } finally {
    window.hetschedConsole.refreshes += 1;
    document.body.dataset.refreshes = String(window.hetschedConsole.refreshes);
    setTimeout(poll, Math.max(0, POLL_MS - (Date.now() - started)));
  }
}

poll();
