"""`mqstore`: run a node, and admin verbs named after mqadmin's, over the node's HTTP API.

    mqstore node --config broker.conf
    mqstore topicList | topicStatus -t T | updateTopic -t T -r 8 -w 8
    mqstore queryMsgById -i ID | queryMsgByUniqueKey -t T -i MSGID | queryMsgByKey -t T -k K
    mqstore queryMsgByOffset -t T -q 0 -o 5 | printMsg -t T [-b TIME -e TIME]
    mqstore brokerStatus | send -t T -b hello | pull -t T -q 0 -o 0
    mqstore clusterList | topicRoute -t T | deleteTopic -t T | getBrokerConfig
    mqstore consumerProgress [-g G] | consumerConnection -g G | resetOffsetByTime -g G -t T -s now
    mqstore deleteExpiredCommitLog [--all]
Every admin verb takes `-n host:port` (default 127.0.0.1:10911) and `--json` for scripts.
Tables use mqadmin's columns so existing habits and scripts carry over.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import datetime as dt
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

from mqstore.client.errors import not_leader_hint

DEFAULT_ENDPOINT = "127.0.0.1:10911"
HTTP_TIMEOUT_S = 35.0          # above the broker's long-poll cap for `pull --wait`


class CliError(Exception):
    """Printed as `ERROR: ...` with exit code 1."""


# --- HTTP ----------------------------------------------------------------------------------------
# (access key, secret key) that sign every request (aclEnable nodes); set by main from
# --access-key/--secret-key or MQSTORE_ACCESS_KEY/MQSTORE_SECRET_KEY.
CREDENTIALS: tuple[str, str] | None = None
# ssl.SSLContext trusting --tls-ca / MQSTORE_TLS_CA (tlsEnable nodes); None = plain http.
TLS_CONTEXT: Any = None


def call(endpoint: str, method: str, path: str, doc: dict | None = None) -> Any:
    """One request to `endpoint`. A NOT_LEADER answer (nothing was done) is followed to the
    leader it names, at most twice; one naming no leader (an election under way) is tried
    again for up to NO_LEADER_WAIT_S. One that says the outcome is unknown is not repeated."""
    deadline = time.monotonic() + NO_LEADER_WAIT_S
    redirects = 0
    for _ in range(MAX_ATTEMPTS):
        try:
            return _call_once(endpoint, method, path, doc)
        except _NotLeader as e:
            if "unknown" in e.text:
                raise CliError(e.text) from None
            if e.leader and e.leader != endpoint and redirects < 2:
                endpoint, redirects = e.leader, redirects + 1
            elif time.monotonic() >= deadline:
                raise CliError(e.text) from None
            else:
                time.sleep(0.25)
    raise CliError(f"no leader answered {method} {path} in {NO_LEADER_WAIT_S:.0f} s")


NO_LEADER_WAIT_S = 5.0
MAX_ATTEMPTS = 40          # 0.25 s apart: the wait above, and two redirects


class _NotLeader(Exception):
    def __init__(self, text: str, leader: str | None):
        super().__init__(text)
        self.text, self.leader = text, leader


def _call_once(endpoint: str, method: str, path: str, doc: dict | None = None) -> Any:
    url = f"{'https' if TLS_CONTEXT is not None else 'http'}://{endpoint}{path}"
    data = json.dumps(doc).encode() if doc is not None else None
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if os.environ.get("MQSTORE_CLUSTER_SECRET_FILE"):   # controllers with a cluster secret (docs/security.md)
        from node.peer_auth import load_secret, sign_request
        try:
            secret = load_secret(secret_file=os.environ["MQSTORE_CLUSTER_SECRET_FILE"])
        except ValueError as e:
            raise CliError(f"MQSTORE_CLUSTER_SECRET_FILE: {e}") from None
        headers.update(sign_request(secret, "mqstore-cli", method, path, data or b""))
    if CREDENTIALS is not None:
        from node.acl import sign_headers
        headers.update(sign_headers(CREDENTIALS[0], CREDENTIALS[1], method, path, None, data,
                                    int(time.time() * 1000)))
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S, context=TLS_CONTEXT) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        text = _describe_error(e, body)
        if e.code == 421:
            raise _NotLeader(text, not_leader_hint(body)) from None
        if e.code == 401 and "cluster secret" in text and not os.environ.get("MQSTORE_CLUSTER_SECRET_FILE"):
            text += " (set MQSTORE_CLUSTER_SECRET_FILE to the cluster's secret file)"
        raise CliError(text) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise CliError(f"cannot reach the node at {endpoint}: {reason}") from None


def set_credentials(access_key: str | None, secret_key: str | None) -> None:
    global CREDENTIALS
    if bool(access_key) != bool(secret_key):
        raise CliError("give both --access-key and --secret-key (or MQSTORE_ACCESS_KEY and MQSTORE_SECRET_KEY)")
    CREDENTIALS = (access_key, secret_key) if access_key else None


def set_tls_ca(ca_file: str | None) -> None:
    global TLS_CONTEXT
    TLS_CONTEXT = None
    if ca_file:
        from node.config import ConfigError
        from node.tls import client_context_from_env
        try:
            TLS_CONTEXT = client_context_from_env(ca_file)
        except (ConfigError, OSError) as e:
            raise CliError(str(e)) from None


def _describe_error(e: urllib.error.HTTPError, body: bytes | None = None) -> str:
    try:
        doc = json.loads(e.read() if body is None else body)
        text = f"{doc['error']}: {doc['message']}"
        if doc.get("leader"):
            text += f" (leader: {doc['leader']})"
        return f"{text} [HTTP {e.code}]"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {e.code} {e.reason}"


def q(value: str) -> str:
    return urllib.parse.quote(str(value), safe="")


# --- formatting ----------------------------------------------------------------------------------
def human_ms(ms: int) -> str:
    """RocketMQ UtilAll.timeMillisToHumanString2: yyyy-MM-dd HH:mm:ss,SSS (local time)."""
    t = dt.datetime.fromtimestamp(ms / 1000)
    return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{ms % 1000:03d}"


def body_of(m: dict) -> bytes:
    return m["body"].encode() if "body" in m else base64.b64decode(m["body_b64"])


def message_dump(m: dict, body_dir: str | None = None) -> str:
    """mqadmin queryMsgById's field dump (`%-20s %s`)."""
    body = body_of(m)
    body_dir = body_dir or os.path.join(tempfile.gettempdir(), "mqstore", "msgbodys")
    os.makedirs(body_dir, exist_ok=True)
    path = os.path.join(body_dir, m["msg_id"])
    with open(path, "wb") as f:
        f.write(body)
    rows = [("OffsetID:", m["offset_msg_id"]), ("Topic:", m["topic"]),
            ("Tags:", f"[{m['tags'] or ''}]"), ("Keys:", f"[{' '.join(m['keys'])}]"),
            ("Queue ID:", m["queue_id"]), ("Queue Offset:", m["queue_offset"]),
            ("CommitLog Offset:", m["commitlog_offset"]), ("Reconsume Times:", m["reconsume_times"]),
            ("Born Timestamp:", human_ms(m["born_timestamp"])), ("Store Timestamp:", human_ms(m["store_timestamp"])),
            ("Born Host:", m.get("born_host", "")), ("Store Host:", m.get("store_host", "")),
            ("Properties:", json.dumps(m["properties"], sort_keys=True)), ("Message Body Path:", path)]
    if "body" in m:
        rows.append(("Message Body:", m["body"]))
    return "".join(f"{k:<20} {v}\n" for k, v in rows)


def topic_status_table(broker_name: str, queues: list[dict]) -> str:
    out = ["%-32s  %-4s  %-20s  %-20s    %s" % ("#Broker Name", "#QID", "#Min Offset", "#Max Offset",
                                                 "#Last Updated")]
    for qs in queues:
        last = human_ms(qs["last_updated"]) if qs["last_updated"] > 0 else ""
        out.append("%-32s  %-4d  %-20d  %-20d    %s" % (broker_name[:32], qs["queue_id"], qs["min_offset"],
                                                       qs["max_offset"], last))
    return "\n".join(out) + "\n"


def key_table(messages: list[dict]) -> str:
    out = ["%-50s %4s %40s" % ("#Message ID", "#QID", "#Offset")]
    out += ["%-50s %4d %40d" % (m["msg_id"], m["queue_id"], m["queue_offset"]) for m in messages]
    return "\n".join(out) + "\n"


def key_values(doc: dict, prefix: str = "") -> str:
    """brokerStatus: `key : value` lines, nested maps flattened with dots, sorted."""
    lines = []
    for k in sorted(doc):
        v = doc[k]
        if isinstance(v, dict):
            lines.append(key_values(v, f"{prefix}{k}."))
        else:
            lines.append("%-32s: %s\n" % (f"{prefix}{k}", v))
    return "".join(lines)


def send_result_line(r: dict, topic: str, broker_name: str) -> str:
    return (f"SendResult [sendStatus={r['status']}, msgId={r['msg_id']}, offsetMsgId={r['offset_msg_id']}, "
            f"messageQueue=MessageQueue [topic={topic}, brokerName={broker_name}, queueId={r['queue_id']}], "
            f"queueOffset={r['queue_offset']}]\n")


def human_s(ms: int) -> str:
    """RocketMQ UtilAll.formatDate(YYYY_MM_DD_HH_MM_SS): yyyy-MM-dd HH:mm:ss (local time)."""
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def now_ms() -> int:
    """The wall clock in ms (one place, so the golden tests can pin it)."""
    return int(dt.datetime.now().timestamp() * 1000)


def _pc_wait(n: dict) -> str:
    """#PCWait(ms): mqadmin shows the commitlog lock hold time of the put in progress; a node
    reports its longest log append (replication and flush included) over the last 10 s."""
    wait = (n.get("cluster") or {}).get("put_wait_ms") if n.get("reachable") else None
    return "-" if wait is None else "%d" % wait


def _hours(n: dict, now: int) -> str:
    """#Hour: hours of data on disk, from the oldest commitlog record's store time to now
    (mqadmin's `(now - earliestMessageTimeStamp) / 3600000.0`, "%2.2f"); 0.00 when the log is empty."""
    c = n.get("cluster") or {}
    if not n.get("reachable") or "earliest_store_timestamp" not in c:
        return "-"
    earliest = c["earliest_store_timestamp"]
    return "%2.2f" % (max(0, now - earliest) / 3_600_000.0) if earliest else "0.00"


def cluster_list_table(doc: dict, now: int | None = None) -> str:
    """mqadmin clusterList: one row per replica; BID 0 is the leader/master, the others count up."""
    now = now_ms() if now is None else now
    out = ["%-16s  %-22s  %-4s  %-22s %-16s %19s %19s %10s %5s %6s" % (
        "#Cluster Name", "#Broker Name", "#BID", "#Addr", "#Version", "#InTPS(LOAD)", "#OutTPS(LOAD)",
        "#PCWait(ms)", "#Hour", "#SPACE")]
    nodes = sorted(doc["nodes"], key=lambda n: (not _is_writer(n), n["node_id"]))
    for bid, n in enumerate(nodes):
        c = n.get("cluster") or {}
        log = c.get("log") or {}
        space = log.get("disk_usage_ratio")
        out.append("%-16s  %-22s  %-4s  %-22s %-16s %19s %19s %10s %5s %-6s" % (
            doc["cluster"], doc["group"], bid, n["api"], _version(n),
            "%9.2f(%s,%sms)" % (c.get("in_tps", 0.0), 0, 0) if n["reachable"] else "-",
            "%9.2f(%s,%sms)" % (c.get("out_tps", 0.0), 0, 0) if n["reachable"] else "-",
            _pc_wait(n), _hours(n, now), "%.4f" % space if space is not None else "-"))
    return "\n".join(out) + "\n"


STATS_HEAD = "%-64s  %-64s %12s %11s %11s %14s %14s"
STATS_ROW = "%-64s  %-64s %12d %11.2f %11.2f %14d %14d"
STATS_NO_CONSUMER = "%-64s  %-64s %12d %11.2f %11s %14d %14s"


def stats_all_table(doc: dict, active_only: bool = False) -> str:
    """mqadmin statsAll: a row per topic and consumer group (NO_CONSUMER when it has none);
    `active_only` (-a): rows with messages in or out over the last day."""
    out = [STATS_HEAD % ("#Topic", "#Consumer Group", "#Accumulation", "#InTPS", "#OutTPS", "#InMsg24Hour",
                         "#OutMsg24Hour")]
    for t in doc["topics"]:
        topic = t["topic"][:64]
        for g in t["groups"]:
            if not active_only or t["in_msg_24h"] > 0 or g["out_msg_24h"] > 0:
                out.append(STATS_ROW % (topic, g["group"][:64], g["accumulation"], t["in_tps"], g["out_tps"],
                                        t["in_msg_24h"], g["out_msg_24h"]))
        if not t["groups"] and (not active_only or t["in_msg_24h"] > 0):
            out.append(STATS_NO_CONSUMER % (topic, "", 0, t["in_tps"], "", t["in_msg_24h"], "NO_CONSUMER"))
    return "\n".join(out) + "\n"


def merge_stats(docs: list[dict], accumulation_from: dict) -> dict:
    """The group's statsAll from its members' /stats: each counts what was sent to it and
    pulled from it, so rates and counts add up; a group's accumulation is one view of the
    replicated offsets and queues (`accumulation_from`: the leader's or master's when reached)."""
    acc = {(t["topic"], g["group"]): g["accumulation"] for t in accumulation_from["topics"] for g in t["groups"]}
    topics: dict[str, dict] = {}
    for doc in docs:
        for t in doc["topics"]:
            m = topics.setdefault(t["topic"], {"topic": t["topic"], "in_tps": 0.0, "in_msg_24h": 0, "groups": {}})
            m["in_tps"] += t["in_tps"]
            m["in_msg_24h"] += t["in_msg_24h"]
            for g in t["groups"]:
                mg = m["groups"].setdefault(g["group"], {"group": g["group"], "out_tps": 0.0, "out_msg_24h": 0,
                                                         "accumulation": acc.get((t["topic"], g["group"]),
                                                                                 g["accumulation"])})
                mg["out_tps"] += g["out_tps"]
                mg["out_msg_24h"] += g["out_msg_24h"]
    return {"broker_name": accumulation_from.get("broker_name", ""),
            "topics": [{**m, "in_tps": round(m["in_tps"], 2),
                        "groups": [{**g, "out_tps": round(g["out_tps"], 2)} for _, g in sorted(m["groups"].items())]}
                       for _, m in sorted(topics.items())]}


def _is_writer(n: dict) -> bool:
    return bool(n.get("reachable")) and (n.get("cluster") or {}).get("role") in ("LEADER", "MASTER", "STANDALONE")


def _version(n: dict) -> str:
    from mqstore import __version__
    return f"mqstore-{__version__}" if n.get("reachable") else "UNREACHABLE"


def topic_route_doc(topic_doc: dict, nodes_doc: dict) -> dict:
    """TopicRouteData as mqadmin topicRoute prints it (brokerDatas, queueDatas)."""
    nodes = sorted(nodes_doc["nodes"], key=lambda n: (not _is_writer(n), n["node_id"]))
    addrs = {str(bid): n["api"] for bid, n in enumerate(nodes)}
    return {"brokerDatas": [{"brokerAddrs": addrs, "brokerName": nodes_doc["group"], "cluster": nodes_doc["cluster"]}],
            "filterServerTable": {},
            "queueDatas": [{"brokerName": nodes_doc["group"], "perm": topic_doc["perm"],
                            "readQueueNums": topic_doc["read_queue_nums"], "topicSysFlag": 0,
                            "writeQueueNums": topic_doc["write_queue_nums"]}]}


def client_ip(client_id: str) -> str:
    """The IP part of a RocketMQ client id (`ip@instance`), as mqadmin's #Client IP column shows it."""
    return client_id.split("@", 1)[0] or client_id


def allocate_queues(doc: dict, members: list[dict], read_queue_nums: dict[str, int]) -> dict[tuple[str, int], str]:
    """(topic, queue_id) -> client id owning it, by the clients' own rule: AllocateMessageQueueAveragely
    over the topic's read queues and the sorted live members subscribed to the topic."""
    from mqstore.client.consumer import allocate_averagely
    from mqstore.client.message import MessageQueue
    owners: dict[tuple[str, int], str] = {}
    topics = sorted({r["topic"] for r in doc["queues"]})
    for topic in topics:
        ids = sorted(m["client_id"] for m in members if topic in m.get("topics", ()))
        queue_ids = (range(read_queue_nums[topic]) if topic in read_queue_nums
                     else sorted({r["queue_id"] for r in doc["queues"] if r["topic"] == topic}))
        queues = [MessageQueue(topic, doc["broker_name"], qid) for qid in queue_ids]
        for cid in ids:
            for mq in allocate_averagely(queues, ids, cid):
                owners[(topic, mq.queue_id)] = cid
    return owners


def consumer_progress_table(doc: dict) -> str:
    """mqadmin consumerProgress -g G: per queue offsets, owning client, diff and last consumed time."""
    out = ["%-64s  %-32s  %-4s  %-20s  %-20s  %-20s %-20s  %s" % (
        "#Topic", "#Broker Name", "#QID", "#Broker Offset", "#Consumer Offset", "#Client IP", "#Diff", "#LastTime")]
    for r in doc["queues"]:
        last = human_s(r["last_timestamp"]) if r["last_timestamp"] > 0 else "N/A"
        owner = r.get("client_id")
        out.append("%-64s  %-32s  %-4d  %-20d  %-20d  %-20s %-20d  %s" % (
            r["topic"][:64], doc["broker_name"][:32], r["queue_id"], r["broker_offset"], r["consumer_offset"],
            client_ip(owner)[:20] if owner else "N/A", r["diff"], last))
    out.append("")
    out.append("Consume TPS: %.2f" % doc.get("consume_tps", 0.0))
    out.append("Diff Total: %d" % doc["diff_total"])
    return "\n".join(out) + "\n"


def _version_key(version: str) -> tuple:
    """`0.10.2` sorts after `0.9.1`; a part that is no number sorts by its text."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in version.split("."))


def _first_said(members: list[dict] | None, key: str) -> str:
    """What the first member whose heartbeat gives `key` says of it ("" if none does)."""
    return next((m[key] for m in members or () if m.get(key)), "")


def consumer_groups_table(progress: list[dict]) -> str:
    """mqadmin consumerProgress without -g: one row per group. #Count is the live members (None:
    the node could not say, shown N/A); a group without members is OFFLINE, as in mqadmin.
    #Version is the lowest client version the members' heartbeats give (N/A: none gives one),
    #Type PUSH or PULL and #Model as they give them."""
    out = ["%-64s  %-6s  %-24s %-5s  %-14s  %-7s  %s" % ("#Group", "#Count", "#Version", "#Type", "#Model",
                                                          "#TPS", "#Diff Total")]
    for p in progress:
        members = p.get("members")
        count = "N/A" if members is None else str(len(members))
        versions = [m["version"] for m in members or () if m.get("version")]
        version = "N/A" if members is None else ("OFFLINE" if not members else
                                                 min(versions, key=_version_key) if versions else "N/A")
        kind = {"CONSUME_PASSIVELY": "PUSH", "CONSUME_ACTIVELY": "PULL"}.get(_first_said(members, "consume_type"), "")
        model = _first_said(members, "message_model") or ("CLUSTERING" if members else "")
        out.append("%-64s  %-6s  %-24s %-5s  %-14s  %-7d  %d" % (p["group"][:64], count, version, kind, model,
                                                                  int(p.get("consume_tps", 0)), p["diff_total"]))
    return "\n".join(out) + "\n"


def reset_offset_table(doc: dict, timestamp_text: str | None) -> str:
    """resetOffsetByTime's banner and table; skipAccumulatedMessage's table alone (no timestamp)."""
    out = [] if timestamp_text is None else [
        "rollback consumer offset by specified group[%s], topic[%s], timestamp(string)[%s], timestamp(long)[%s]"
        % (doc["group"], doc["topic"], timestamp_text, doc["timestamp"])]
    out.append("%-40s  %-40s  %-40s" % ("#brokerName", "#queueId", "#offset"))
    out += ["%-40s  %-40d  %-40d" % (doc["broker_name"], r["queue_id"], r["offset"]) for r in doc["queues"]]
    return "\n".join(out) + "\n"


def broker_config_text(doc: dict) -> str:
    """mqadmin getBrokerConfig: a banner with the address, then `key=  value` sorted."""
    lines = ["============%s============" % doc["api"]]
    lines += ["%-50s=  %s" % (k, v) for k, v in sorted(doc["config"].items())]
    return "\n".join(lines) + "\n"


def parse_timestamp(text: str, now_ms: int | None = None) -> int:
    """resetOffsetByTime -s: `now`, milliseconds, or yyyy-MM-dd#HH:mm:ss:SSS (local time)."""
    if text == "now":
        return now_ms if now_ms is not None else int(dt.datetime.now().timestamp() * 1000)
    if text.isdigit():
        return int(text)
    try:
        t = dt.datetime.strptime(text, "%Y-%m-%d#%H:%M:%S:%f")
    except ValueError:
        raise CliError(f"timestamp {text!r} is not `now`, milliseconds or yyyy-MM-dd#HH:mm:ss:SSS") from None
    return int(t.timestamp() * 1000)


def _true_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


# --- verbs ---------------------------------------------------------------------------------------
def _broker_name(ep: str) -> str:
    return call(ep, "GET", "/health").get("group", "")


def cmd_topic_list(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", "/topics")
    return doc, "".join(t["topic"] + "\n" for t in doc["topics"])


def cmd_topic_status(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", f"/topics/{q(a.topic)}")
    return doc, topic_status_table(_broker_name(a.endpoint), doc["queues"])


def cmd_update_topic(a) -> tuple[Any, str]:
    body: dict[str, Any] = {"topic": a.topic}
    for field, value in (("read_queues", a.read_queues), ("write_queues", a.write_queues), ("perm", a.perm)):
        if value is not None:
            body[field] = value
    if a.read_queues is not None and a.write_queues is None:
        body["write_queues"] = a.read_queues
    if a.write_queues is not None and a.read_queues is None:
        body["read_queues"] = a.write_queues
    if "read_queues" in body:
        body["queues"] = max(body["read_queues"], body["write_queues"])
    doc = call(a.endpoint, "POST", "/topics", body)
    text = (f"create topic to {a.endpoint} success.\n"
            f"TopicConfig [topicName={doc['topic']}, readQueueNums={doc['read_queue_nums']}, "
            f"writeQueueNums={doc['write_queue_nums']}, perm={doc['perm']}]\n")
    return doc, text


def cmd_query_by_id(a) -> tuple[Any, str]:
    """By offsetMsgId; with a topic, an id that is no offsetMsgId here is then taken as a
    msgId (the producer's UNIQ_KEY), as mqadmin's queryMsgById does."""
    try:
        doc = call(a.endpoint, "GET", f"/messages/{q(a.msg_id)}")
    except CliError:
        if not a.topic:
            raise
        return cmd_query_by_unique_key(a)
    return doc, message_dump(doc)


UNIQUE_KEY_CANDIDATES = 32    # index hits read per msgId (a KEYS word may equal one too)


def cmd_query_by_unique_key(a) -> tuple[Any, str]:
    """mqadmin queryMsgByUniqueKey: the message(s) whose msgId (UNIQ_KEY) is `-i`, found through
    the index (messages sent again with the same msgId: every copy, oldest first)."""
    path = f"/topics/{q(a.topic)}/messages?key={q(a.msg_id)}&max={UNIQUE_KEY_CANDIDATES}"
    found = [m for m in call(a.endpoint, "GET", path)["messages"] if m["msg_id"] == a.msg_id]
    if not found:
        raise CliError(f"no message with msgId {a.msg_id} in topic {a.topic} (is it an offsetMsgId? "
                       f"queryMsgById -i)")
    return {"messages": found}, "\n".join(message_dump(m) for m in found)


def cmd_query_by_key(a) -> tuple[Any, str]:
    path = f"/topics/{q(a.topic)}/messages?key={q(a.key)}&max={a.max}"
    if a.begin is not None:
        path += f"&begin={a.begin}"
    if a.end is not None:
        path += f"&end={a.end}"
    doc = call(a.endpoint, "GET", path)
    return doc, key_table(doc["messages"])


def cmd_query_by_offset(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", f"/topics/{q(a.topic)}/queues/{a.queue}/messages/{a.offset}")
    return doc, message_dump(doc)


def cmd_broker_status(a) -> tuple[Any, str]:
    doc = {"health": call(a.endpoint, "GET", "/health"), "cluster": call(a.endpoint, "GET", "/cluster")}
    return doc, key_values({**doc["health"], **{k: v for k, v in doc["cluster"].items() if k not in doc["health"]}})


def cmd_cluster_list(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", "/cluster/nodes")
    return doc, cluster_list_table(doc)


def cmd_topic_route(a) -> tuple[Any, str]:
    route = topic_route_doc(call(a.endpoint, "GET", f"/topics/{q(a.topic)}"), call(a.endpoint, "GET", "/cluster/nodes"))
    return route, json.dumps(route, indent=2, sort_keys=True) + "\n"


def cmd_delete_topic(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "DELETE", f"/topics/{q(a.topic)}")
    cluster = a.cluster or call(a.endpoint, "GET", "/cluster").get("cluster", "")
    return doc, f"delete topic [{a.topic}] from cluster [{cluster}] success.\n"


def cmd_delete_expired_commitlog(a) -> tuple[Any, str]:
    targets = [a.endpoint]
    if a.all:
        targets = [n["api"] for n in call(a.endpoint, "GET", "/cluster/nodes")["nodes"]]
    docs, lines = [], []
    for addr in targets:
        try:
            doc = call(addr, "POST", "/commitlog/delete-expired", {})
        except CliError as e:
            if not a.all:
                raise
            docs.append({"api": addr, "error": str(e)})
            lines.append(f"deleteExpiredCommitLog on {addr}: failed: {e}\n")
            continue
        docs.append(doc)
        lines.append(f"deleteExpiredCommitLog on {addr} [{doc['broker_name']}]: success (the next "
                     f"{doc['manual_delete_passes']} retention passes delete files older than fileReservedTime "
                     f"at any hour)\n")
    if all("error" in d for d in docs):
        raise CliError("".join(lines).strip())
    return {"nodes": docs}, "".join(lines)


def _group_members(endpoint: str, group: str) -> list[dict] | None:
    """Live members of a group, or None (with a warning on stderr) when the node cannot say: the
    membership table lives on the node that accepts writes, and a follower refuses."""
    try:
        return call(endpoint, "GET", f"/groups/{q(group)}/members")["members"]
    except CliError as e:
        print(f"WARN: members of group {group!r} unknown: {e}", file=sys.stderr)
        return None


def with_members(doc: dict, members: list[dict] | None, read_queue_nums: dict[str, int]) -> dict:
    """The progress document plus `members` and, per queue, the `client_id` that owns it (None: no owner)."""
    owners = allocate_queues(doc, members or [], read_queue_nums)
    return {**doc, "members": members,
            "queues": [{**r, "client_id": owners.get((r["topic"], r["queue_id"]))} for r in doc["queues"]]}


def cmd_consumer_progress(a) -> tuple[Any, str]:
    if a.group:
        path = f"/groups/{q(a.group)}/progress" + (f"?topic={q(a.topic)}" if a.topic else "")
        doc = call(a.endpoint, "GET", path)
        members = _group_members(a.endpoint, a.group)
        read_queue_nums: dict[str, int] = {}
        for topic in sorted({r["topic"] for r in doc["queues"]}) if members else ():
            try:
                read_queue_nums[topic] = call(a.endpoint, "GET", f"/topics/{q(topic)}")["read_queue_nums"]
            except CliError:
                pass    # a deleted topic with offsets left: allocate over the queues the offsets name
        doc = with_members(doc, members, read_queue_nums)
        return doc, consumer_progress_table(doc)
    groups = call(a.endpoint, "GET", "/groups")["groups"]
    progress = [{**call(a.endpoint, "GET", f"/groups/{q(g)}/progress"), "members": _group_members(a.endpoint, g)}
                for g in groups]
    return {"groups": progress}, consumer_groups_table(progress)


def cmd_stats_all(a) -> tuple[Any, str]:
    path = "/stats" + (f"?topic={q(a.topic)}" if a.topic else "")
    nodes = call(a.endpoint, "GET", "/cluster/nodes")["nodes"]
    docs, first = [], None
    for n in sorted(nodes, key=lambda n: not _is_writer(n)):
        if not n.get("reachable"):
            print(f"WARN: {n['api']} unreachable: its counts are left out", file=sys.stderr)
            continue
        try:
            doc = call(n["api"], "GET", path)
        except CliError as e:
            print(f"WARN: {n['api']}: {e}: its counts are left out", file=sys.stderr)
            continue
        docs.append(doc)
        first = first or doc
    if first is None:
        raise CliError(f"no member of the group of {a.endpoint} answered")
    doc = merge_stats(docs, first)
    return doc, stats_all_table(doc, a.active_topic)


def consumer_connection_text(group: str, members: list[dict]) -> str:
    """mqadmin consumerConnection (RocketMQ 5's columns): one row per live member, the group's
    subscriptions over every member, then the consume type, message model and where a new
    queue starts, as the members' heartbeats give them."""
    if not members:
        raise CliError(f"the consumer group[{group}] not online")
    out = ["%-36s %-22s %-10s %s" % ("#ClientId", "#ClientAddr", "#Language", "#Version")]
    out += ["%-36s %-22s %-10s %s" % (m["client_id"], m.get("addr") or "-", m.get("language") or "-",
                                      m.get("version") or "-") for m in members]
    subs: dict[str, str] = {}
    for m in members:
        for topic in m.get("topics", ()):
            subs.setdefault(topic, (m.get("subscriptions") or {}).get(topic, "*"))
    out += ["", "Below is subscription:", "%-20s %s" % ("#Topic", "#SubExpression")]
    out += ["%-20s %s" % (t, subs[t]) for t in sorted(subs)]
    said = {k: _first_said(members, k) or "-" for k in ("consume_type", "message_model", "consume_from_where")}
    out += ["", f"ConsumeType: {said['consume_type']}", f"MessageModel: {said['message_model']}",
            f"ConsumeFromWhere: {said['consume_from_where']}"]
    return "\n".join(out) + "\n"


def cmd_consumer_connection(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", f"/groups/{q(a.group)}/members")
    return doc, consumer_connection_text(a.group, doc["members"])


def cmd_reset_offset_by_time(a) -> tuple[Any, str]:
    ts = parse_timestamp(a.timestamp)
    doc = call(a.endpoint, "POST", f"/groups/{q(a.group)}/offsets/reset?topic={q(a.topic)}&timestamp={ts}", {})
    return doc, reset_offset_table(doc, a.timestamp)


def cmd_skip_accumulated(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "POST", f"/groups/{q(a.group)}/offsets/reset?topic={q(a.topic)}&timestamp=-1", {})
    return doc, reset_offset_table(doc, None)


def cmd_clone_group_offset(a) -> tuple[Any, str]:
    """The source group's committed offsets on the topic, committed for the destination group
    (each a replicated commit); queues the source never committed are left as they are."""
    rows = call(a.endpoint, "GET", f"/groups/{q(a.src_group)}/offsets?topic={q(a.topic)}")["offsets"]
    done = [call(a.endpoint, "POST", f"/groups/{q(a.dest_group)}/offsets",
                 {"topic": r["topic"], "queue_id": r["queue_id"], "offset": r["offset"]}) for r in rows]
    doc = {"src_group": a.src_group, "dest_group": a.dest_group, "topic": a.topic, "offsets": done}
    return doc, "clone group offset success. srcGroup[%s], destGroup=[%s], topic[%s]\n" % (
        a.src_group, a.dest_group, a.topic)


def cmd_get_broker_config(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", "/config")
    return doc, broker_config_text(doc)


def cmd_send(a) -> tuple[Any, str]:
    msg: dict[str, Any] = {"body": a.body}
    if a.tags:
        msg["tags"] = a.tags
    if a.keys:
        msg["keys"] = a.keys
    if a.queue is not None:
        msg["queue_id"] = a.queue
    doc = call(a.endpoint, "POST", f"/topics/{q(a.topic)}/messages", {"messages": [msg]})
    name = _broker_name(a.endpoint)
    return doc, "".join(send_result_line(r, a.topic, name) for r in doc["results"])


def cmd_pull(a) -> tuple[Any, str]:
    path = f"/topics/{q(a.topic)}/queues/{a.queue}/messages?offset={a.offset}&max={a.max}&wait_ms={a.wait_ms}"
    if a.tags:
        path += f"&tags={q(a.tags)}"
    doc = call(a.endpoint, "GET", path)
    head = (f"status={doc['status']} next_offset={doc['next_offset']} min_offset={doc['min_offset']} "
            f"max_offset={doc['max_offset']} messages={len(doc['messages'])}\n")
    rows = [f"{m['queue_offset']:<10} {m['offset_msg_id']}  tags={m['tags'] or ''}  "
            f"body={m['body'] if 'body' in m else '<base64> ' + m['body_b64']}\n" for m in doc["messages"]]
    return doc, head + "".join(rows)


PRINT_MSG_BATCH = 32           # messages per pull (mqadmin printMsg's)


def message_ext_text(m: dict, broker_name: str) -> str:
    """RocketMQ MessageExt.toString, with the fields a pull returns (the body by its size)."""
    props = ", ".join(f"{k}={v}" for k, v in sorted(m["properties"].items()))
    return (f"MessageExt [brokerName={broker_name}, queueId={m['queue_id']}, queueOffset={m['queue_offset']}, "
            f"bornTimestamp={m['born_timestamp']}, bornHost={m.get('born_host', '')}, "
            f"storeTimestamp={m['store_timestamp']}, storeHost={m.get('store_host', '')}, "
            f"msgId={m['offset_msg_id']}, commitLogOffset={m['commitlog_offset']}, bodyCRC={m.get('body_crc', 0)}, "
            f"reconsumeTimes={m['reconsume_times']}, toString()=Message{{topic='{m['topic']}', "
            f"properties={{{props}}}, body=<{len(body_of(m))} bytes>}}]")


def cmd_print_msg(a) -> tuple[Any, str]:
    """mqadmin printMsg: every message of each queue of the topic from its min offset (or the
    first stored at -b) up to its max offset (or the first stored at -e), pulled 32 at a time,
    with mqadmin's lines."""
    try:
        codecs.lookup(a.charset)
    except LookupError:
        raise CliError(f"unknown charset {a.charset!r}") from None
    begin = parse_timestamp(a.begin) if a.begin else None
    end = parse_timestamp(a.end) if a.end else None
    name = _broker_name(a.endpoint)
    docs, lines = [], []
    for qs in call(a.endpoint, "GET", f"/topics/{q(a.topic)}")["queues"]:
        qid = qs["queue_id"]
        lo, hi = qs["min_offset"], qs["max_offset"]
        if begin is not None:
            lo = call(a.endpoint, "GET", f"/topics/{q(a.topic)}/queues/{qid}/offset?timestamp={begin}")["offset"]
        if end is not None:
            hi = call(a.endpoint, "GET", f"/topics/{q(a.topic)}/queues/{qid}/offset?timestamp={end}")["offset"]
        mq = f"MessageQueue [topic={a.topic}, brokerName={name}, queueId={qid}]"
        lines.append(f"minOffset={lo}, maxOffset={hi}, {mq}\n")
        got: list[dict] = []
        offset = lo
        while offset < hi:
            doc = call(a.endpoint, "GET", f"/topics/{q(a.topic)}/queues/{qid}/messages?offset={offset}"
                                          f"&max={PRINT_MSG_BATCH}&tags={q(a.sub_expression)}")
            status, nxt = doc["status"], doc["next_offset"]
            if status == "FOUND":
                for m in doc["messages"]:
                    if m["queue_offset"] >= hi:
                        break
                    got.append(m)
                    body = body_of(m).decode(a.charset, errors="replace") if a.print_body else "NOT PRINT BODY"
                    lines.append(f"MSGID: {m['msg_id']} {message_ext_text(m, name)} BODY: {body}\n")
            elif status == "NO_MATCHED_MSG":
                lines.append(f"{mq} no matched msg. status={status}, offset={nxt}\n")
            else:       # NO_NEW_MSG, OFFSET_ILLEGAL: nothing more here
                lines.append(f"{mq} print msg finished. status={status}, offset={nxt}\n")
                break
            if nxt <= offset:
                break   # no progress (the queue moved under us): stop rather than loop
            offset = nxt
        docs.append({"queue_id": qid, "min_offset": lo, "max_offset": hi, "messages": got})
    return {"topic": a.topic, "queues": docs}, "".join(lines)


def cmd_node(a) -> int:
    from node.__main__ import main as node_main
    return node_main(["--config", a.config] if a.config else [])


def cmd_cluster(a) -> int:
    try:
        from mqstore import cluster
    except ImportError as e:
        raise CliError(f"`mqstore cluster` is not built yet ({e})") from None
    if a.action == "up":
        nodes = a.nodes if a.nodes is not None else (2 if a.mode == "classic" else 3)
        return cluster.up_main(a.dir, a.mode, nodes, a.base_port, a.detach, a.secure,
                               broker_role=a.broker_role, controllers=a.controllers)
    stopped = cluster.stop(a.dir)
    print(f"stopped {len(stopped)} process(es)")
    return 0


def cmd_controller(a) -> int:
    from ha.controller_server import main as controller_main
    return controller_main(a.rest)


def cmd_pipeline(a) -> int:
    from pipeline.cli import main as pipeline_main
    return pipeline_main(a.rest)


def cmd_not_built(a) -> int:
    raise CliError(f"`mqstore {a.verb}` is not built yet")


# --- parser --------------------------------------------------------------------------------------
def _admin(sub, name: str, fn: Callable, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("-n", "--endpoint", default=os.environ.get("MQSTORE_ENDPOINT", DEFAULT_ENDPOINT),
                   help="node API host:port (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    p.add_argument("--access-key", default=os.environ.get("MQSTORE_ACCESS_KEY"),
                   help="sign requests with this access key (aclEnable nodes; env MQSTORE_ACCESS_KEY)")
    p.add_argument("--secret-key", default=os.environ.get("MQSTORE_SECRET_KEY"),
                   help="secret key of --access-key (env MQSTORE_SECRET_KEY)")
    p.add_argument("--tls-ca", default=os.environ.get("MQSTORE_TLS_CA"),
                   help="speak https, trusting this PEM CA file (tlsEnable nodes; env MQSTORE_TLS_CA)")
    p.set_defaults(fn=fn, admin=True)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mqstore", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("node", help="run a node")
    p.add_argument("-c", "--config", help="broker.conf")
    p.set_defaults(fn=cmd_node, admin=False)
    p = sub.add_parser("cluster", help="local cluster of node processes")
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--dir", default="./mqstore-cluster")
    p.add_argument("--mode", default="dledger", choices=["dledger", "standalone", "classic"],
                   help="dledger: a Raft group; standalone: one node; classic: controllers and a "
                        "master/slave group")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the group (dledger 3, classic 2)")
    p.add_argument("--broker-role", default="SYNC_MASTER", choices=["SYNC_MASTER", "ASYNC_MASTER"],
                   help="classic: the role a master takes (brokerRole; default %(default)s)")
    p.add_argument("--controllers", type=int, default=3, choices=[1, 3, 5],
                   help="classic: controller processes (default %(default)s)")
    p.add_argument("--base-port", type=int, default=10911)
    p.add_argument("--detach", action="store_true")
    p.add_argument("--secure", action="store_true",
                   help="ACL on with a generated admin key, peers authenticated with a generated cluster "
                        "secret (both written to --dir and printed)")
    p.set_defaults(fn=cmd_cluster, admin=False)
    for verb, fn, text in (("controller", cmd_controller, "run a controller (`mqstore controller --help`)"),
                           ("pipeline", cmd_pipeline, "PySpark jobs over a store (`mqstore pipeline --help`)")):
        p = sub.add_parser(verb, help=text, add_help=False)   # parsed by main's PASSTHROUGH
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=fn, admin=False)
    from mqstore import admin_ha
    admin_ha.register(sub, _admin)
    _admin(sub, "topicList", cmd_topic_list, "list topics")
    _admin(sub, "topicStatus", cmd_topic_status, "per-queue offsets").add_argument("-t", "--topic", required=True)
    p = _admin(sub, "updateTopic", cmd_update_topic, "create or update a topic")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-r", "--read-queues", type=int)
    p.add_argument("-w", "--write-queues", type=int)
    p.add_argument("-p", "--perm", type=int)
    p = _admin(sub, "queryMsgById", cmd_query_by_id, "query by offsetMsgId (or, with -t, by msgId)")
    p.add_argument("-i", "--msg-id", required=True)
    p.add_argument("-t", "--topic", help="the topic: an id that is no offsetMsgId is taken as a msgId")
    p = _admin(sub, "queryMsgByUniqueKey", cmd_query_by_unique_key, "query by msgId (the producer's UNIQ_KEY)")
    p.add_argument("-i", "--msg-id", required=True)
    p.add_argument("-t", "--topic", required=True)
    p = _admin(sub, "queryMsgByKey", cmd_query_by_key, "query by key")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-k", "--key", required=True)
    p.add_argument("-b", "--begin", type=int)
    p.add_argument("-e", "--end", type=int)
    p.add_argument("-m", "--max", type=int, default=32)
    p = _admin(sub, "queryMsgByOffset", cmd_query_by_offset, "query by queue offset")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-q", "--queue", type=int, required=True)
    p.add_argument("-o", "--offset", type=int, required=True)
    _admin(sub, "brokerStatus", cmd_broker_status, "node status")
    _admin(sub, "clusterList", cmd_cluster_list, "replicas of the node's group, roles and TPS")
    _admin(sub, "topicRoute", cmd_topic_route, "route data of a topic").add_argument("-t", "--topic", required=True)
    p = _admin(sub, "deleteTopic", cmd_delete_topic, "delete a topic: config, consume queues, consumer offsets")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-c", "--cluster", help="cluster name (printed only)")
    p = _admin(sub, "consumerProgress", cmd_consumer_progress, "consumer offsets and lag (all groups without -g)")
    p.add_argument("-g", "--group")
    p.add_argument("-t", "--topic")
    p = _admin(sub, "consumerConnection", cmd_consumer_connection,
               "a consumer group's live members: address, language, version, subscriptions")
    p.add_argument("-g", "--group", required=True)
    p = _admin(sub, "resetOffsetByTime", cmd_reset_offset_by_time, "move a group's offsets to a store time")
    p.add_argument("-g", "--group", required=True)
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-s", "--timestamp", required=True, help="now, ms, or yyyy-MM-dd#HH:mm:ss:SSS")
    p = _admin(sub, "skipAccumulatedMessage", cmd_skip_accumulated,
               "move a group's offsets on a topic past every message stored (its max offsets)")
    p.add_argument("-g", "--group", required=True)
    p.add_argument("-t", "--topic", required=True)
    p = _admin(sub, "cloneGroupOffset", cmd_clone_group_offset, "commit one group's offsets on a topic for another")
    p.add_argument("-s", "--src-group", required=True)
    p.add_argument("-d", "--dest-group", required=True)
    p.add_argument("-t", "--topic", required=True)
    p = _admin(sub, "statsAll", cmd_stats_all, "per topic and consumer group: accumulation, TPS in and out, "
                                                "messages in and out over the last day (every member of the group)")
    p.add_argument("-a", "--active-topic", action="store_true", help="only topics with messages in the last day")
    p.add_argument("-t", "--topic", help="only this topic")
    _admin(sub, "getBrokerConfig", cmd_get_broker_config, "the node's broker.conf values")
    p = _admin(sub, "deleteExpiredCommitLog", cmd_delete_expired_commitlog,
               "delete commitlog files older than fileReservedTime now, not at deleteWhen's hour")
    p.add_argument("--all", action="store_true", help="every member of the node's group (/cluster/nodes)")
    p = _admin(sub, "printMsg", cmd_print_msg, "print every message of a topic's queues (a store-time range with -b/-e)")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-c", "--charset", default="utf-8", help="the bodies' charset (default utf-8)")
    p.add_argument("-s", "--sub-expression", default="*", help="tags: `*` or `TagA || TagB`")
    p.add_argument("-b", "--begin", help="store time to start at: ms or yyyy-MM-dd#HH:mm:ss:SSS")
    p.add_argument("-e", "--end", help="store time to stop at: ms or yyyy-MM-dd#HH:mm:ss:SSS")
    p.add_argument("-d", "--print-body", type=_true_false, default=True, help="true (default) or false")
    p = _admin(sub, "send", cmd_send, "send one message")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-b", "--body", required=True)
    p.add_argument("--tags")
    p.add_argument("--keys", help="space-separated keys")
    p.add_argument("-q", "--queue", type=int)
    p = _admin(sub, "pull", cmd_pull, "pull from a queue")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-q", "--queue", type=int, required=True)
    p.add_argument("-o", "--offset", type=int, required=True)
    p.add_argument("-m", "--max", type=int, default=32)
    p.add_argument("--tags")
    p.add_argument("--wait-ms", type=int, default=0)
    return parser


# Verbs that own their whole argument list (their own --help, their own flags).
def cmd_drill(a) -> int:
    # deploy/ lives beside the installed packages in a source checkout (editable install)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "deploy", "drills")):
        print("ERROR: `mqstore drill` runs from a source checkout (deploy/drills is missing)", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    from deploy.drills.__main__ import main as drill_main
    return drill_main(a.rest)


PASSTHROUGH = {"controller": cmd_controller, "pipeline": cmd_pipeline, "drill": cmd_drill}


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        if not args.admin:
            return args.fn(args)
        set_credentials(args.access_key, args.secret_key)
        set_tls_ca(args.tls_ca)
        doc, text = args.fn(args)
    except CliError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n" if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
