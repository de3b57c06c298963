// The operator's page of the PSPF admin API: plain DOM calls over the JSON routes.
// Every value shown goes in as text (textContent), never as HTML: DLQ entries hold user data.
"use strict";

const TOKEN_KEY = "pspf-admin-token";
const SHOWN = 500; // at most this many DLQ entries or outbox rows in a table

const $ = (id) => document.getElementById(id);

/** An element with text children (strings) or elements; attributes set one by one. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "onclick") node.addEventListener("click", value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  }
  return node;
}

function fill(table, rows) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows);
}

function say(id, text, kind) {
  const node = $(id);
  node.textContent = text;
  node.className = "status" + (kind ? " " + kind : "");
}

const path = (...parts) => parts.map(encodeURIComponent).join("/");

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

/** Call the API; resolves to the JSON body, rejects with an Error saying what the API answered. */
async function api(method, url, body) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && token()) headers.Authorization = "Bearer " + token();
  const response = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new Error((data && data.error) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return data;
}

function refusal(error) {
  if (error.status === 401 || error.status === 403) {
    const hint = token() ? "the token was refused" : "read-only: paste the admin token above to change anything";
    return `refused (${error.status}): ${hint}. The API said: ${error.message}`;
  }
  return `failed${error.status ? " (" + error.status + ")" : ""}: ${error.message}`;
}

// -- token ---------------------------------------------------------------------------------------

function showMode() {
  const writable = Boolean(token());
  $("mode").textContent = writable
    ? "Token in use for this tab: redrive and purge are sent with it (the API checks it)."
    : "Read-only: without the admin token the API refuses redrive and purge.";
  $("mode").className = writable ? "ok" : "muted";
  $("token-forget").disabled = !writable;
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const given = $("token").value.trim();
  if (given) sessionStorage.setItem(TOKEN_KEY, given);
  $("token").value = "";
  showMode();
});

$("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showMode();
});

// -- overview ------------------------------------------------------------------------------------

let openTopic = null;
let openApp = null;

async function loadHealth() {
  try {
    const health = await api("GET", "/health");
    say("health", `${health.server || "Redis"} ${health.redis_version} answers in ${health.latency_ms.toFixed(1)} ms`, "ok");
  } catch (error) {
    say("health", "Redis: " + error.message, "error");
  }
}

async function loadTopics() {
  try {
    const topics = await api("GET", "/topics");
    fill($("topics"), topics.map((t) => el("tr", { "data-topic": t.name },
      el("td", {}, el("button", { type: "button", class: "link", onclick: () => showTopic(t.name) }, t.name)),
      el("td", { class: "num" }, t.partitions))));
    say("topics-status", topics.length ? "" : "no topics yet");
  } catch (error) {
    say("topics-status", refusal(error), "error");
  }
}

async function loadApps() {
  try {
    const apps = await api("GET", "/groups");
    fill($("apps"), apps.map((a) => el("tr", { "data-app": a.app },
      el("td", {}, el("button", { type: "button", class: "link", onclick: () => showApp(a.app) }, a.app)),
      el("td", {}, a.topics.join(", ")),
      el("td", { class: "num" }, a.error ? "?" : a.lag),
      el("td", { class: "num" }, a.pending),
      el("td", { class: "num" }, a.dead_letters),
      el("td", {}, a.error ? "cannot read: " + a.error : a.owners.length + (a.owners.length === 1 ? " worker" : " workers")))));
    say("apps-status", apps.length ? "" : "no apps have run here yet");
  } catch (error) {
    say("apps-status", refusal(error), "error");
  }
}

// -- a topic: partitions and its DLQ -------------------------------------------------------------

async function showTopic(name) {
  openTopic = name;
  $("topic-detail").hidden = false;
  $("topic-name").textContent = name;
  $("dlq-entry").hidden = true;
  say("dlq-result", "");
  resetDryRun();
  try {
    const topic = await api("GET", "/topics/" + path(name));
    fill($("partitions"), topic.partitions.map((p) => el("tr", {},
      el("td", { class: "num" }, p.partition),
      el("td", { class: "num" }, p.length),
      el("td", {}, p.last_id || "–"),
      el("td", {}, p.groups.map((g) => `${g.name} (${g.pending})`).join(", ") || "–"))));
  } catch (error) {
    fill($("partitions"), []);
    say("dlq-status", refusal(error), "error");
    return;
  }
  await loadDlq();
}

async function loadDlq() {
  try {
    const entries = await api("GET", `/topics/${path(openTopic)}/dlq?limit=${SHOWN}`);
    $("dlq-check-all").checked = false;
    fill($("dlq"), entries.map((d) => el("tr", { "data-dlq-id": d.dlq_id },
      el("td", {}, el("input", { type: "checkbox", class: "dlq-check", value: d.dlq_id, "aria-label": "check " + d.dlq_id })),
      el("td", {}, el("button", { type: "button", class: "link", onclick: () => showEntry(d.dlq_id) }, d.dlq_id)),
      el("td", {}, d.key == null ? "–" : d.key),
      el("td", {}, d.app),
      el("td", {}, d.error_type),
      el("td", { class: "message" }, d.message),
      el("td", { class: "num" }, d.attempts),
      el("td", {}, d.failed_at))));
    const more = entries.length >= SHOWN ? ` (the first ${SHOWN} shown)` : "";
    say("dlq-status", entries.length ? `${entries.length} entries${more}` : "the DLQ is empty");
  } catch (error) {
    fill($("dlq"), []);
    say("dlq-status", refusal(error), "error");
  }
}

async function showEntry(dlqId) {
  try {
    const entry = await api("GET", `/topics/${path(openTopic)}/dlq/${path(dlqId)}`);
    $("dlq-entry-id").textContent = entry.dlq_id;
    const shown = ["source_topic", "source_partition", "source_id", "key", "app", "consumer", "error_type",
      "message", "attempts", "first_failed_at", "last_failed_at", "value_bytes"];
    $("dlq-entry-fields").replaceChildren(...shown.flatMap((name) => [
      el("dt", {}, name.replaceAll("_", " ")), el("dd", { "data-field": name }, entry[name] == null ? "–" : entry[name])]));
    $("dlq-value").textContent = JSON.stringify({ headers: entry.headers, value: entry.value }, null, 2);
    $("dlq-traceback").textContent = entry.traceback;
    $("dlq-entry").hidden = false;
  } catch (error) {
    say("dlq-result", refusal(error), "error");
  }
}

$("dlq-check-all").addEventListener("change", (event) => {
  for (const box of document.querySelectorAll(".dlq-check")) box.checked = event.target.checked;
  resetDryRun();
});
$("dlq").addEventListener("change", (event) => {
  if (event.target.classList.contains("dlq-check")) resetDryRun();
});
$("dlq-action").addEventListener("change", resetDryRun);
$("dlq-scope").addEventListener("change", resetDryRun);

// A change is sent for real only after a dry run of the very same request.
let dryRun = null;

function resetDryRun() {
  dryRun = null;
  $("dlq-confirm").disabled = true;
  $("dlq-confirm").textContent = "Run it";
}

function dlqRequest() {
  const action = $("dlq-action").value;
  if ($("dlq-scope").value === "all") return { action, body: { all: true } };
  const ids = [...document.querySelectorAll(".dlq-check:checked")].map((box) => box.value);
  return ids.length ? { action, body: { ids } } : null;
}

$("dlq-dry-run").addEventListener("click", async () => {
  resetDryRun();
  const request = dlqRequest();
  if (!request) {
    say("dlq-result", "check some entries first, or choose every DLQ entry of the topic", "error");
    return;
  }
  const url = `/topics/${path(openTopic)}/dlq/${request.action}`;
  try {
    const change = await api("POST", url, { ...request.body, dry_run: true });
    const verb = request.action === "redrive" ? "redrive" : "delete";
    say("dlq-result", `dry run: would ${verb} ${change.selected} entries; nothing changed`, "ok");
    if (change.selected > 0) {
      dryRun = { url, body: request.body };
      $("dlq-confirm").disabled = false;
      $("dlq-confirm").textContent = `${request.action === "redrive" ? "Redrive" : "Purge"} ${change.selected} entries`;
    }
  } catch (error) {
    say("dlq-result", refusal(error), "error");
  }
});

$("dlq-confirm").addEventListener("click", async () => {
  if (!dryRun) return;
  const { url, body } = dryRun;
  resetDryRun();
  try {
    const change = await api("POST", url, body);
    const done = url.endsWith("/redrive") ? "redrove" : "deleted";
    say("dlq-result", `${done} ${change.changed} of ${change.selected} selected entries`, "ok");
  } catch (error) {
    say("dlq-result", refusal(error), "error");
  }
  await loadDlq();
  await loadApps();
});

// -- an app: lag per partition, workers, outbox --------------------------------------------------

function age(seconds) {
  if (seconds == null) return "–";
  return seconds < 120 ? `${seconds.toFixed(1)} s` : `${(seconds / 60).toFixed(0)} min`;
}

async function showApp(name) {
  openApp = name;
  $("app-detail").hidden = false;
  $("app-name").textContent = name;
  try {
    const lag = await api("GET", `/apps/${path(name)}/lag`);
    fill($("lag"), lag.detail.map((d) => el("tr", { "data-topic": d.topic, "data-partition": d.partition },
      el("td", {}, d.topic),
      el("td", { class: "num" }, d.partition),
      el("td", {}, d.last_id || "–"),
      el("td", {}, d.checkpoint || "–"),
      el("td", { class: "num lag" }, d.lag),
      el("td", { class: "num" }, d.pending),
      el("td", {}, age(d.oldest_pending_age_s)),
      el("td", { class: "owner" }, d.owner || "nobody"),
      el("td", { class: "num" }, d.dead_letters))));
    const members = lag.members.map((m) => el("tr", {},
      el("td", {}, m.id), el("td", {}, m.host), el("td", { class: "num" }, m.pid), el("td", {}, m.since),
      el("td", {}, m.last_heartbeat), el("td", {}, m.partitions.join(", ") || "–")));
    fill($("members"), members.length ? members : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "no live workers"))]);
  } catch (error) {
    fill($("lag"), []);
    fill($("members"), []);
    say("outbox-summary", refusal(error), "error");
    return;
  }
  await loadOutbox(name);
}

async function loadOutbox(name) {
  $("outbox").hidden = true;
  try {
    const rows = await api("GET", `/apps/${path(name)}/outbox?limit=${SHOWN}`);
    const counts = {};
    for (const row of rows) counts[row.state] = (counts[row.state] || 0) + 1;
    const summary = Object.entries(counts).map(([state, n]) => `${n} ${state}`).join(", ");
    say("outbox-summary", rows.length ? `outbox rows: ${summary}` : "the outbox has no rows");
    fill($("outbox"), rows.map((r) => el("tr", { "data-row-id": r.row_id },
      el("td", {}, r.row_id), el("td", {}, r.state), el("td", {}, `${r.topic}/${r.partition}`),
      el("td", {}, r.key == null ? "–" : r.key), el("td", { class: "num" }, r.attempts),
      el("td", { class: "message" }, r.last_error || "–"), el("td", {}, r.created_at), el("td", {}, r.source || "–"))));
    $("outbox").hidden = rows.length === 0;
  } catch (error) {
    say("outbox-summary", error.status === 404 ? "no outbox: " + error.message : refusal(error), error.status === 404 ? "" : "error");
  }
}

// -- start ---------------------------------------------------------------------------------------

async function refresh() {
  await Promise.all([loadHealth(), loadTopics(), loadApps()]);
  if (openTopic) await showTopic(openTopic);
  if (openApp) await showApp(openApp);
}

$("refresh").addEventListener("click", refresh);
showMode();
refresh();
