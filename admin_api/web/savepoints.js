// The savepoints of the app on screen: list, take, restore (the app or a fork) and delete.
// Loaded before app.js, whose helpers ($, el, api, say, refusal, ...) these functions call once the
// page has started; app.js calls wireSavepoints() then, and loadSavepoints(name) with each app.
"use strict";

// Like the app's reset: a restore or a deletion is sent for real only after a dry run of the very
// same request has shown what it would do.
let savepointPlan = null;

function resetSavepointPlan() {
  savepointPlan = null;
  $("savepoint-confirm").disabled = true;
  $("savepoint-confirm").textContent = "Run it";
}

/** The app's savepoints, oldest first, each with its restore and delete buttons. */
async function loadSavepoints(name) {
  try {
    const entries = await api("GET", `/apps/${path(name)}/savepoints`);
    if (openApp !== name) return;
    fill($("savepoints"), entries.map((s) => el("tr", { "data-savepoint": s.name },
      el("td", {}, s.name),
      el("td", {}, new Date(s.taken_ms).toISOString()),
      el("td", { class: "state" }, s.state),
      el("td", { class: "num" }, s.keys),
      el("td", { class: "value" }, s.path),
      el("td", {},
        el("button", { type: "button", class: "savepoint-restore", "data-name": s.name, "data-path": s.path,
          ...(s.state === "complete" ? {} : { disabled: "", title: "not finished: take it again with --resume" }) },
        "Restore…"),
        " ",
        el("button", { type: "button", class: "savepoint-delete", "data-name": s.name }, "Delete…")))));
    say("savepoints-status", entries.length ? "" : "no savepoints yet");
  } catch (error) {
    if (openApp !== name) return;
    fill($("savepoints"), []);
    say("savepoints-status", refusal(error), "error");
  }
}

function restoreSummary(result) {
  const what = result.fork ? `fork ${result.target} of app ${result.app}` : `app ${result.app}`;
  const split = result.mode === "split"
    ? `, split from ${result.partitions_saved} into ${result.partitions} partitions` : "";
  const counts = `${result.keys} keys, ${result.partitions} partitions${split}; `
    + `${result.entries_to_handle} entries to handle after the cut`;
  return result.dry_run
    ? `dry run: would restore ${what} from ${result.source}: ${counts}; nothing changed`
    : `restored ${what} from ${result.source}: ${counts}`;
}

function showRestorePlan(result) {
  const lines = [
    `savepoint: ${result.source}`,
    result.fork ? `into the new app ${result.target} (a fork: no outbox rows, its own outputs)`
      : `into the app ${result.target}: its state and positions replaced`,
    `partitions: ${result.partitions} (${result.mode === "split" ? "split or merged by key from " + result.partitions_saved : "as saved"})`,
    `state keys: ${result.keys}, values: ${result.values}`,
    `entries to handle after the cut: ${result.entries_to_handle}`,
  ];
  $("savepoint-plan").replaceChildren(...lines.map((line) => el("li", {}, line)));
  $("savepoint-plan").hidden = false;
}

async function restoreDryRun(source) {
  const app = openApp;
  const target = $("restore-as").value.trim();
  const body = target && target !== app ? { from: source, as: target } : { from: source };
  const result = await api("POST", `/apps/${path(app)}/restore`, { ...body, dry_run: true });
  if (openApp !== app) return;
  say("savepoint-result", restoreSummary(result), "ok");
  showRestorePlan(result);
  savepointPlan = { app, kind: "restore", method: "POST", url: `/apps/${path(app)}/restore`, body };
  $("savepoint-confirm").textContent = result.fork ? `Restore fork ${result.target}` : `Restore app ${app}`;
  $("savepoint-confirm").disabled = false;
}

async function deleteDryRun(name) {
  const app = openApp;
  const url = `/apps/${path(app)}/savepoints/${path(name)}`;
  const entry = await api("DELETE", url + "?dry_run=true");
  if (openApp !== app) return;
  say("savepoint-result", `dry run: would delete savepoint ${entry.name} and its files (${entry.path}); nothing changed`, "ok");
  $("savepoint-plan").hidden = true;
  savepointPlan = { app, kind: "delete", method: "DELETE", url, body: undefined };
  $("savepoint-confirm").textContent = `Delete savepoint ${entry.name}`;
  $("savepoint-confirm").disabled = false;
}

async function takeSavepoint() {
  const app = openApp;
  const to = $("savepoint-to").value.trim();
  const name = $("savepoint-name").value.trim();
  resetSavepointPlan();
  $("savepoint-plan").hidden = true;
  if (!to) {
    say("savepoint-result", "say where to write it first: a directory, or s3://bucket/prefix", "error");
    return;
  }
  say("savepoint-result", `taking a savepoint of ${app}…`);
  try {
    const taken = await api("POST", `/apps/${path(app)}/savepoints`, name ? { to, name } : { to });
    say("savepoint-result", `took savepoint ${taken.name} of ${taken.app} (app ${taken.stopped ? "stopped" : "running"}): `
      + `${taken.partitions} partitions, ${taken.keys} keys, ${taken.values} values, ${taken.bytes} bytes, in ${taken.path}`, "ok");
    $("savepoint-name").value = "";
  } catch (error) {
    say("savepoint-result", refusal(error), "error");
  }
  if (openApp === app) await loadSavepoints(app);
}

async function confirmSavepointPlan() {
  if (!savepointPlan) return;
  const { app, kind, method, url, body } = savepointPlan;
  resetSavepointPlan();
  try {
    const result = await api(method, url, body);
    if (kind === "delete") {
      say("savepoint-result", `deleted savepoint ${result.name} and its files (${result.path})`, "ok");
    } else {
      say("savepoint-result", restoreSummary(result), "ok");
      showRestorePlan(result);
    }
  } catch (error) {
    say("savepoint-result", refusal(error), "error");
  }
  await loadApps();
  if (openApp === app) await showApp(app);
}

function wireSavepoints() {
  $("savepoint-take").addEventListener("click", takeSavepoint);
  $("savepoint-confirm").addEventListener("click", confirmSavepointPlan);
  $("restore-as").addEventListener("input", resetSavepointPlan);
  $("savepoints").addEventListener("click", async (event) => {
    const button = event.target.closest("button");
    if (!button || button.disabled) return;
    resetSavepointPlan();
    $("savepoint-plan").hidden = true;
    try {
      if (button.classList.contains("savepoint-restore")) await restoreDryRun(button.dataset.path);
      else if (button.classList.contains("savepoint-delete")) await deleteDryRun(button.dataset.name);
    } catch (error) {
      say("savepoint-result", refusal(error), "error");
    }
  });
}
