// mqstore dashboard: polls the API of the process that served this page (same origin).
// Plain JS, no build step. Every request has a timeout and the poll never overlaps itself.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 3000;
const MAX_TOPICS = 50;
const MAX_GROUPS = 50;

// --- access keys (aclEnable=true) -------------------------------------------------------------
// Kept in sessionStorage only: they go when the tab closes and are never sent, only used to sign.
const AK_KEY = "mqstore.accessKey";
const SK_KEY = "mqstore.secretKey";

function storedKeys() {
  const ak = sessionStorage.getItem(AK_KEY), sk = sessionStorage.getItem(SK_KEY);
  return ak && sk ? { ak, sk } : null;
}

class ApiError extends Error {
  constructor(status, code, message) {
    super(`${status} ${code}: ${message}`);
    this.status = status;
    this.code = code;
  }
}

async function getJSON(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const headers = { Accept: "application/json" };
    const keys = storedKeys();
    if (keys) Object.assign(headers, await MQSign.headers(keys.ak, keys.sk, "GET", path, null));
    const r = await fetch(path, { headers, signal: ctl.signal });
    const doc = await r.json();
    if (!r.ok) {
      const err = new ApiError(r.status, doc.error || "HTTP", doc.message || "");
      err.keys = keys;   // which keys (if any) signed the refused request
      throw err;
    }
    return doc;
  } finally {
    clearTimeout(timer);
  }
}

function showAuth(text, cls) {
  const s = document.getElementById("auth-state");
  s.textContent = text;
  s.className = cls || "";
}

function authIdle() {
  const keys = storedKeys();
  showAuth(keys ? `signed in as ${keys.ak}` : "");
  document.getElementById("signout").hidden = !keys;
  document.getElementById("signin").hidden = !keys;   // shown once a 401 asked for keys
}

document.getElementById("signin").addEventListener("submit", ev => {
  ev.preventDefault();
  const ak = document.getElementById("access-key").value.trim();
  const sk = document.getElementById("secret-key").value;
  if (!ak || !sk) {
    showAuth("enter both the access key and the secret key", "error");
    return;
  }
  sessionStorage.setItem(AK_KEY, ak);
  sessionStorage.setItem(SK_KEY, sk);
  document.getElementById("secret-key").value = "";
  showAuth(`checking keys of ${ak}…`);
  document.getElementById("signout").hidden = false;
});

document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem(AK_KEY);
  sessionStorage.removeItem(SK_KEY);
  document.getElementById("signout").hidden = true;
  showAuth("signed out");
});

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) tr.appendChild(el("td", c === undefined || c === null ? "" : c));
  return tr;
}

function headRow(cells) {
  const tr = el("tr");
  for (const c of cells) tr.appendChild(el("th", c));
  return tr;
}

function setRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function fmtTime(ms) {
  return ms > 0 ? new Date(ms).toISOString().replace("T", " ").replace("Z", "") : "";
}

// --- cluster -------------------------------------------------------------------------------
function renderNodes(doc) {
  const table = document.getElementById("nodes");
  table.tHead.replaceChildren(headRow(["Node", "API", "Role", "Term", "Leader", "Commit index", "Applied index",
    "Committed offset", "HA ack offset", "In TPS", "Out TPS"]));
  let leader = null, term = null;
  const rows = doc.nodes.map(n => {
    const c = n.cluster || {};
    const log = c.log || {};
    if (n.reachable && (c.role === "LEADER" || c.role === "MASTER" || c.role === "STANDALONE")) {
      leader = n.node_id; term = log.term;
    }
    const cls = !n.reachable ? "down" : (c.role === "LEADER" || c.role === "MASTER") ? "leader" : "";
    return row([n.node_id, n.api, n.reachable ? c.role : "UNREACHABLE", log.term, log.leader_id || c.leader,
      log.commit_index, log.applied_index, c.committed_offset, log.ha_slave_ack_offset,
      c.in_tps !== undefined ? c.in_tps.toFixed(1) : "", c.out_tps !== undefined ? c.out_tps.toFixed(1) : ""], cls);
  });
  setRows(table.tBodies[0], rows);
  document.getElementById("leader").textContent = leader || "none";
  document.getElementById("term").textContent = term === null || term === undefined ? "-" : term;
}

function renderControllerGroups(health, doc) {
  const table = document.getElementById("nodes");
  table.tHead.replaceChildren(headRow(["Group", "Mode", "Master id", "Master addr", "Master epoch",
    "SyncStateSet", "SSS epoch", "Online", "Brokers"]));
  setRows(table.tBodies[0], doc.groups.map(g => row([g.broker_name, g.mode,
    g.master_id === null || g.master_id === undefined ? "none" : g.master_id, g.master_addr || "",
    g.master_epoch, (g.sync_state_set || []).join(","), g.sss_epoch, (g.online || []).join(","),
    Object.entries(g.broker_addrs || {}).map(([id, addr]) => `${id}=${addr}`).join(" ")],
    g.master_id === null || g.master_id === undefined ? "down" : "")));
  document.getElementById("leader").textContent = health.leader || "none";
  const raft = health.raft || {};
  document.getElementById("term").textContent = raft.raft_term === null || raft.raft_term === undefined
    ? "-" : raft.raft_term;
}

// --- topics and groups ---------------------------------------------------------------------
async function renderTopics() {
  const doc = await getJSON("/topics");
  const rows = [];
  for (const t of doc.topics.slice(0, MAX_TOPICS)) {
    let st;
    try {
      st = await getJSON(`/topics/${encodeURIComponent(t.topic)}`);
    } catch (e) {
      if (e.status !== 403) throw e;
      rows.push(row([t.topic, "", "", "", e.message], "denied"));   // this account lacks PUB/SUB on it
      continue;
    }
    for (const q of st.queues) {
      rows.push(row([t.topic, q.queue_id, q.min_offset, q.max_offset, fmtTime(q.last_updated)]));
    }
  }
  setRows(document.querySelector("#topics tbody"), rows);
}

async function renderGroups() {
  const doc = await getJSON("/groups");
  const rows = [];
  for (const g of doc.groups.slice(0, MAX_GROUPS)) {
    let p;
    try {
      p = await getJSON(`/groups/${encodeURIComponent(g)}/progress`);
    } catch (e) {
      if (e.status !== 403) throw e;
      rows.push(row([g, "", "", "", "", e.message], "denied"));
      continue;
    }
    for (const q of p.queues) {
      rows.push(row([g, q.topic, q.queue_id, q.broker_offset, q.consumer_offset, q.diff]));
    }
  }
  setRows(document.querySelector("#groups tbody"), rows);
}

async function renderReports() {
  const doc = await getJSON("/dashboard/reports");
  const items = doc.reports.map(r => {
    const li = el("li");
    const a = el("a", r.name);
    a.href = `/dashboard/reports/${encodeURIComponent(r.name)}`;
    li.appendChild(a);
    li.appendChild(document.createTextNode(` ${r.size} bytes, ${fmtTime(r.mtime * 1000)}`));
    return li;
  });
  if (!items.length) items.push(el("li", `no reports in ${doc.dir}`));
  document.getElementById("reports").replaceChildren(...items);
}

// --- lookup ----------------------------------------------------------------------------------
async function lookup(path) {
  const out = document.getElementById("lookup-result");
  try {
    out.className = "";
    out.textContent = JSON.stringify(await getJSON(path), null, 2);
  } catch (e) {
    out.className = "error";
    out.textContent = String(e.message || e);
  }
}

document.getElementById("by-id").addEventListener("submit", ev => {
  ev.preventDefault();
  lookup(`/messages/${encodeURIComponent(document.getElementById("msg-id").value.trim())}`);
});
document.getElementById("by-key").addEventListener("submit", ev => {
  ev.preventDefault();
  const topic = encodeURIComponent(document.getElementById("key-topic").value.trim());
  const key = encodeURIComponent(document.getElementById("key-key").value.trim());
  lookup(`/topics/${topic}/messages?key=${key}`);
});

// --- poll ------------------------------------------------------------------------------------
async function poll() {
  const served = document.getElementById("served-by");
  try {
    const health = await getJSON("/health");
    if (health.mode === "controller") {
      served.textContent = `controller · ${health.role}`;
      renderControllerGroups(health, await getJSON("/groups"));
      document.getElementById("topics-section").hidden = true;
      document.getElementById("groups-section").hidden = true;
      document.getElementById("lookup-section").hidden = true;
    } else {
      served.textContent = `node ${health.node_id} · group ${health.group} · ${health.mode} · ${health.role}`;
      renderNodes(await getJSON("/cluster/nodes"));
      await renderTopics();
      await renderGroups();
    }
    await renderReports();
    served.className = "";
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    authIdle();
  } catch (e) {
    if (e.status === 401) {
      // aclEnable=true: the page itself is open, its data needs a signature.
      served.className = "";
      const now = storedKeys();
      if (now && !(e.keys && e.keys.ak === now.ak && e.keys.sk === now.sk)) {
        // keys were entered or changed while this request was out: the next poll uses them
      } else if (now) {
        showAuth(`keys refused: ${e.message}`, "error");
      } else {
        showAuth("sign in required: this node checks signed requests (aclEnable=true); "
          + "enter an access key and secret key", "warn");
      }
      document.getElementById("signin").hidden = false;
    } else {
      served.className = "error";
      served.textContent = `cannot read this node: ${e.message || e}`;
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
