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
/** The page's own address of a view (see "views and their URLs" below). */
const href = (...parts) => "#/" + path(...parts);

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
    ? "Token in use for this tab: redrive, purge, reset, savepoints and delete are sent with it (the API checks it)."
    : "Read-only: without the admin token the API refuses redrive, purge, reset, savepoints and delete.";
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

// -- views and their URLs ------------------------------------------------------------------------
// Each view has a hash route, so a reload keeps it, a link shares it, and back and forward work:
//   #/                     the overview (#/topics and #/apps: the same, at that list)
//   #/topics/NAME          a topic: partitions, latest entries, DLQ
//   #/topics/NAME/dlq/ID   the same, with one DLQ entry open
//   #/apps/NAME            an app: lag, workers, outbox, savepoints, reset and delete
// Every part is URI-encoded, so any name makes the trip.

let openTopic = null;
let openApp = null;
let shown = { view: "overview" }; // the route on screen

function routeOf(hash) {
  let parts;
  try {
    parts = hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  } catch {
    return { view: "overview", unknown: true }; // a malformed %-escape
  }
  const [kind, name, sub, id] = parts;
  if (kind === "topics" && parts.length === 2) return { view: "topic", topic: name };
  if (kind === "topics" && parts.length === 4 && sub === "dlq") return { view: "topic", topic: name, dlqId: id };
  if (kind === "apps" && parts.length === 2) return { view: "app", app: name };
  if (parts.length === 0 || (parts.length === 1 && (kind === "topics" || kind === "apps"))) {
    return { view: "overview", list: kind };
  }
  return { view: "overview", unknown: true };
}

function scrollTo(id) {
  $(id).scrollIntoView({ block: "start" });
}

/** Show the view the address names; ``reload`` reads its data again even when it is on screen. */
async function render(reload) {
  const route = routeOf(location.hash);
  const before = shown;
  shown = route;
  $("route-status").hidden = !route.unknown;
  $("route-status").textContent = route.unknown ? `no view at ${location.hash}: the overview is shown` : "";
  $("topic-detail").hidden = route.view !== "topic";
  $("app-detail").hidden = route.view !== "app";
  openTopic = route.view === "topic" ? route.topic : null;
  openApp = route.view === "app" ? route.app : null;
  document.title = "PSPF admin" + (openTopic ? ` · topic ${openTopic}` : openApp ? ` · app ${openApp}` : "");
  const moved = route.view !== before.view || route.topic !== before.topic || route.app !== before.app;
  if (route.view === "topic") {
    if (moved || reload) await showTopic(route.topic);
    if (openTopic !== route.topic) return; // the user went on meanwhile
    if (route.dlqId) await showEntry(route.dlqId);
    else $("dlq-entry").hidden = true;
    if (route.dlqId && route.dlqId !== before.dlqId && !$("dlq-entry").hidden) scrollTo("dlq-entry");
    else if (moved) scrollTo("topic-detail");
  } else if (route.view === "app") {
    if (moved || reload) await showApp(route.app);
    if (moved && openApp === route.app) scrollTo("app-detail");
  } else if (moved || route.list !== before.list) {
    if (route.list) scrollTo(route.list + "-list");
    else window.scrollTo(0, 0);
  }
}

// -- overview ------------------------------------------------------------------------------------

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
      el("td", {}, el("a", { href: href("topics", t.name) }, t.name)),
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
      el("td", {}, el("a", { href: href("apps", a.app) }, a.app)),
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

// -- a topic: partitions, latest entries and its DLQ ---------------------------------------------

async function showTopic(name) {
  $("topic-name").textContent = name;
  $("dlq-entry").hidden = true;
  say("dlq-result", "");
  resetDryRun();
  topicPlan = null;
  $("topic-confirm").disabled = true;
  $("topic-plan").hidden = true;
  say("topic-result", "");
  try {
    const topic = await api("GET", "/topics/" + path(name));
    if (openTopic !== name) return;
    fill($("partitions"), topic.partitions.map((p) => el("tr", {},
      el("td", { class: "num" }, p.partition),
      el("td", { class: "num" }, p.length),
      el("td", {}, p.last_id || "–"),
      el("td", {}, p.groups.map((g) => `${g.name} (${g.pending})`).join(", ") || "–"))));
    choosePartitions(name, topic.partitions.length);
  } catch (error) {
    if (openTopic !== name) return;
    for (const table of ["partitions", "entries", "dlq"]) fill($(table), []);
    say("entries-status", refusal(error), "error");
    say("dlq-status", refusal(error), "error");
    return;
  }
  await Promise.all([loadSchema(), loadEntries(), loadDlq()]);
}

/** The topic's current schema (``pspf topic schema``), or that it has none. */
async function loadSchema() {
  const name = openTopic;
  try {
    const found = await api("GET", `/topics/${path(name)}/schema`);
    if (openTopic !== name) return;
    const at = new Date(found.set_at_ms).toISOString();
    say("schema-status", `version ${found.version} (${found.compat}), set ${at}; every door checks values against it`);
    $("schema").textContent = JSON.stringify(found.schema, null, 2);
    $("schema").hidden = false;
  } catch (error) {
    if (openTopic !== name) return;
    $("schema").hidden = true;
    say("schema-status", error.status === 404 ? "no schema: values are not checked" : refusal(error), error.status === 404 ? "" : "error");
  }
}

let partitionsOf = null; // the topic the partition filter lists

/** The partition filter's choices; the choice made stays while the same topic is shown. */
function choosePartitions(name, count) {
  const select = $("entries-partition");
  const kept = partitionsOf === name ? select.value : "";
  partitionsOf = name;
  const choices = Array.from({ length: count }, (_, p) => el("option", { value: String(p) }, String(p)));
  select.replaceChildren(el("option", { value: "" }, "all"), ...choices);
  select.value = kept !== "" && Number(kept) < count ? kept : "";
}

function compact(value) {
  return value === undefined ? "–" : JSON.stringify(value);
}

function headersText(headers) {
  if (typeof headers === "string") return headers; // not a JSON object: shown as sent
  return Object.keys(headers || {}).length ? JSON.stringify(headers) : "–";
}

async function loadEntries() {
  const name = openTopic;
  const partition = $("entries-partition").value;
  const query = new URLSearchParams({ count: $("entries-count").value });
  if (partition !== "") query.set("partition", partition);
  try {
    const entries = await api("GET", `/topics/${path(name)}/entries?${query}`);
    if (openTopic !== name) return;
    // The API gives the latest entries oldest first; the newest goes on top here.
    fill($("entries"), entries.reverse().map((e) => el("tr", { "data-entry-id": e.id, "data-partition": e.partition },
      el("td", {}, e.id),
      el("td", { class: "num" }, e.partition),
      el("td", {}, e.key == null ? "–" : e.key),
      el("td", { class: "value" }, compact(e.value), e.encoding === "json" ? "" : el("span", { class: "muted" }, ` (${e.encoding})`)),
      el("td", { class: "value" }, headersText(e.headers)))));
    const where = partition === "" ? "the topic" : `partition ${partition}`;
    say("entries-status", entries.length ? `the latest ${entries.length} entries of ${where}, newest first` : `${where} has no entries`);
  } catch (error) {
    if (openTopic !== name) return;
    fill($("entries"), []);
    say("entries-status", refusal(error), "error");
  }
}

$("entries-partition").addEventListener("change", loadEntries);
$("entries-count").addEventListener("change", loadEntries);
$("entries-refresh").addEventListener("click", loadEntries);

async function loadDlq() {
  const name = openTopic;
  try {
    const entries = await api("GET", `/topics/${path(name)}/dlq?limit=${SHOWN}`);
    if (openTopic !== name) return;
    $("dlq-check-all").checked = false;
    fill($("dlq"), entries.map((d) => el("tr", { "data-dlq-id": d.dlq_id },
      el("td", {}, el("input", { type: "checkbox", class: "dlq-check", value: d.dlq_id, "aria-label": "check " + d.dlq_id })),
      el("td", {}, el("a", { href: href("topics", name, "dlq", d.dlq_id) }, d.dlq_id)),
      el("td", {}, d.key == null ? "–" : d.key),
      el("td", {}, d.app),
      el("td", {}, d.error_type),
      el("td", { class: "message" }, d.message),
      el("td", { class: "num" }, d.attempts),
      el("td", {}, d.failed_at))));
    const more = entries.length >= SHOWN ? ` (the first ${SHOWN} shown)` : "";
    say("dlq-status", entries.length ? `${entries.length} entries${more}` : "the DLQ is empty");
  } catch (error) {
    if (openTopic !== name) return;
    fill($("dlq"), []);
    say("dlq-status", refusal(error), "error");
  }
}

async function showEntry(dlqId) {
  const name = openTopic;
  try {
    const entry = await api("GET", `/topics/${path(name)}/dlq/${path(dlqId)}`);
    if (openTopic !== name) return;
    $("dlq-entry-id").textContent = entry.dlq_id;
    const shown = ["source_topic", "source_partition", "source_id", "key", "app", "consumer", "error_type",
      "message", "attempts", "first_failed_at", "last_failed_at", "value_bytes"];
    $("dlq-entry-fields").replaceChildren(...shown.flatMap((name) => [
      el("dt", {}, name.replaceAll("_", " ")), el("dd", { "data-field": name }, entry[name] == null ? "–" : entry[name])]));
    $("dlq-value").textContent = JSON.stringify({ headers: entry.headers, value: entry.value }, null, 2);
    $("dlq-traceback").textContent = entry.traceback;
    $("dlq-entry").hidden = false;
  } catch (error) {
    $("dlq-entry").hidden = true;
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

// Deleting a topic: sent for real only after a dry run of the same topic.
let topicPlan = null;

function showTopicPlan(result) {
  $("topic-plan").replaceChildren(...result.keys.map((key) => el("li", {}, `key ${key}`)));
  $("topic-plan").hidden = false;
}

$("topic-dry-run").addEventListener("click", async () => {
  const name = openTopic;
  topicPlan = null;
  $("topic-confirm").disabled = true;
  try {
    const result = await api("POST", `/topics/${path(name)}/delete`, { dry_run: true });
    if (openTopic !== name) return;
    say("topic-result", `dry run: would remove topic ${name} (${result.partitions} partitions): `
      + `${result.keys.length} keys; nothing changed`, "ok");
    showTopicPlan(result);
    topicPlan = name;
    $("topic-confirm").disabled = false;
  } catch (error) {
    say("topic-result", refusal(error), "error");
  }
});

$("topic-confirm").addEventListener("click", async () => {
  const name = topicPlan;
  if (!name || openTopic !== name) return;
  topicPlan = null;
  $("topic-confirm").disabled = true;
  try {
    const result = await api("POST", `/topics/${path(name)}/delete`, {});
    await loadTopics();
    location.hash = "#/";
    say("topics-status", `removed topic ${name}: ${result.keys.length} keys`, "ok");
  } catch (error) {
    say("topic-result", refusal(error), "error");
  }
});

// -- an app: lag per partition, workers, outbox, reset and delete --------------------------------

function age(seconds) {
  if (seconds == null) return "–";
  return seconds < 120 ? `${seconds.toFixed(1)} s` : `${(seconds / 60).toFixed(0)} min`;
}

let appShown = null; // the app whose reset or delete result is on screen

async function showApp(name) {
  $("app-name").textContent = name;
  $("app-asyncapi").href = `/apps/${path(name)}/asyncapi`;
  if (appShown !== name) {
    appShown = name;
    resetAppPlan();
    say("app-result", "");
    $("app-plan").hidden = true;
    resetSavepointPlan();
    say("savepoint-result", "");
    $("savepoint-plan").hidden = true;
  }
  try {
    const lag = await api("GET", `/apps/${path(name)}/lag`);
    if (openApp !== name) return;
    fill($("lag"), lag.detail.map((d) => el("tr", { "data-topic": d.topic, "data-partition": d.partition },
      el("td", {}, el("a", { href: href("topics", d.topic) }, d.topic)),
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
    if (openApp !== name) return;
    fill($("lag"), []);
    fill($("members"), []);
    fill($("savepoints"), []);
    say("outbox-summary", refusal(error), "error");
    return;
  }
  await Promise.all([loadOutbox(name), loadSavepoints(name)]); // savepoints.js
}

async function loadOutbox(name) {
  $("outbox").hidden = true;
  try {
    const rows = await api("GET", `/apps/${path(name)}/outbox?limit=${SHOWN}`);
    if (openApp !== name) return;
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
    if (openApp !== name) return;
    say("outbox-summary", error.status === 404 ? "no outbox: " + error.message : refusal(error), error.status === 404 ? "" : "error");
  }
}

// Like the DLQ's: a reset or a delete is sent for real only after a dry run of the very same request.
let appPlan = null;

function resetAppPlan() {
  appPlan = null;
  $("app-confirm").disabled = true;
  $("app-confirm").textContent = "Run it";
}

function appRequest() {
  const app = openApp;
  if ($("app-action").value === "delete") {
    return { app, kind: "delete", url: `/apps/${path(app)}/delete`, body: {}, label: `Delete app ${app}` };
  }
  const to = $("app-action").value === "reset-end" ? "end" : "start";
  const body = { to, keep_state: $("app-keep-state").checked };
  return { app, kind: "reset", url: `/apps/${path(app)}/reset`, body, label: `Reset to the ${to}` };
}

/** One sentence on a reset or a delete, as done or (``dryRun``) as it would be done. */
function appSummary(kind, result, dryRun) {
  if (kind === "delete") {
    const what = `app ${result.app} (${result.topics.join(", ")}): ${result.groups.length} groups and ${result.keys.length} keys`;
    return dryRun ? `dry run: would remove ${what}; nothing changed` : `removed ${what}`;
  }
  const what = `${result.app} to the ${result.to} of its topics: ${result.entries_to_process} entries to process, `
    + `${result.entries_skipped} unhandled entries skipped, state ${result.state_reset ? "deleted" : "kept"}`;
  return dryRun ? `dry run: would reset ${what}; nothing changed` : `reset ${what}`;
}

/** The details: for a delete each group and key, for a reset what the app will do next. */
function showAppPlan(kind, result) {
  const lines = kind === "delete"
    ? [...result.groups.map((stream) => `group ${result.app} of ${stream}`), ...result.keys.map((key) => `key ${key}`)]
    : [
      `topics: ${result.topics.join(", ")} (${result.partitions} partitions)`,
      `entries to process: ${result.entries_to_process}`,
      `unhandled entries skipped: ${result.entries_skipped}`,
      `tables rebuilt from their first entry: ${result.tables_rebuilt.join(", ") || "none"}`,
      result.state_reset ? "state: deleted (values, windows, timers, TTLs and table rows)" : "state: kept",
      `stores reset in the API's state dir: partitions ${result.stores_here.join(", ") || "none"} `
        + "(the others restore from the state backup)",
      ...(result.superseded ? [`entries a redriven copy replaces: ${result.superseded}`] : []),
    ];
  $("app-plan").replaceChildren(...lines.map((line) => el("li", {}, line)));
  $("app-plan").hidden = false;
}

function appActionChanged() {
  $("app-keep-state").disabled = $("app-action").value === "delete";
  resetAppPlan();
}

$("app-action").addEventListener("change", appActionChanged);
$("app-keep-state").addEventListener("change", resetAppPlan);

$("app-dry-run").addEventListener("click", async () => {
  resetAppPlan();
  $("app-plan").hidden = true;
  const request = appRequest();
  try {
    const result = await api("POST", request.url, { ...request.body, dry_run: true });
    if (openApp !== request.app) return;
    say("app-result", appSummary(request.kind, result, true), "ok");
    showAppPlan(request.kind, result);
    appPlan = request;
    $("app-confirm").disabled = false;
    $("app-confirm").textContent = request.label;
  } catch (error) {
    say("app-result", refusal(error), "error");
  }
});

$("app-confirm").addEventListener("click", async () => {
  if (!appPlan) return;
  const { app, kind, url, body } = appPlan;
  resetAppPlan();
  try {
    const result = await api("POST", url, body);
    if (kind === "delete") { // the app is gone: back to the overview, which says so
      await loadApps();
      location.hash = "#/";
      say("apps-status", appSummary(kind, result, false), "ok");
      return;
    }
    say("app-result", appSummary(kind, result, false), "ok");
    showAppPlan(kind, result);
  } catch (error) {
    say("app-result", refusal(error), "error");
  }
  await loadApps();
  if (openApp === app) await showApp(app);
});

// -- start ---------------------------------------------------------------------------------------

async function refresh() {
  await Promise.all([loadHealth(), loadTopics(), loadApps()]);
  await render(true);
}

$("refresh").addEventListener("click", refresh);
window.addEventListener("hashchange", () => render(false));
wireSavepoints(); // savepoints.js
showMode();
refresh();
