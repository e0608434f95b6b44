"""`mqstore`: run a node, and admin verbs named after mqadmin's, over the node's HTTP API.

    mqstore node --config broker.conf
    mqstore topicList | topicStatus -t T | updateTopic -t T -r 8 -w 8
    mqstore queryMsgById -i ID | queryMsgByKey -t T -k K | queryMsgByOffset -t T -q 0 -o 5
    mqstore brokerStatus | send -t T -b hello | pull -t T -q 0 -o 0
Every admin verb takes `-n host:port` (default 127.0.0.1:10911) and `--json` for scripts.
Tables use mqadmin's columns so existing habits and scripts carry over.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

DEFAULT_ENDPOINT = "127.0.0.1:10911"
HTTP_TIMEOUT_S = 35.0          # above the broker's long-poll cap for `pull --wait`


class CliError(Exception):
    """Printed as `ERROR: ...` with exit code 1."""


# --- HTTP ----------------------------------------------------------------------------------------
def call(endpoint: str, method: str, path: str, doc: dict | None = None) -> Any:
    url = f"http://{endpoint}{path}"
    data = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                        "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise CliError(_describe_error(e)) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise CliError(f"cannot reach the node at {endpoint}: {reason}") from None


def _describe_error(e: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(e.read())
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
    doc = call(a.endpoint, "GET", f"/messages/{q(a.msg_id)}")
    return doc, message_dump(doc)


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


def cmd_node(a) -> int:
    from node.__main__ import main as node_main
    return node_main(["--config", a.config] if a.config else [])


def cmd_cluster(a) -> int:
    try:
        from mqstore import cluster
    except ImportError as e:
        raise CliError(f"`mqstore cluster` is not built yet ({e})") from None
    if a.action == "up":
        return cluster.up_main(a.dir, a.mode, a.nodes, a.base_port, a.detach)
    stopped = cluster.stop(a.dir)
    print(f"stopped {len(stopped)} node process(es)")
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
    p.add_argument("--mode", default="dledger", choices=["dledger", "standalone"])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--base-port", type=int, default=10911)
    p.add_argument("--detach", action="store_true")
    p.set_defaults(fn=cmd_cluster, admin=False)
    for verb, fn, text in (("controller", cmd_controller, "run a controller (`mqstore controller --help`)"),
                           ("pipeline", cmd_pipeline, "PySpark jobs over a store (`mqstore pipeline --help`)")):
        p = sub.add_parser(verb, help=text, add_help=False)   # parsed by main's PASSTHROUGH
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=fn, admin=False)
    for verb in ("clusterList", "topicRoute", "consumerProgress", "resetOffsetByTime", "haStatus",
                 "getSyncStateSet", "electMaster"):
        p = sub.add_parser(verb, help="not built yet")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=cmd_not_built, admin=False)
    _admin(sub, "topicList", cmd_topic_list, "list topics")
    _admin(sub, "topicStatus", cmd_topic_status, "per-queue offsets").add_argument("-t", "--topic", required=True)
    p = _admin(sub, "updateTopic", cmd_update_topic, "create or update a topic")
    p.add_argument("-t", "--topic", required=True)
    p.add_argument("-r", "--read-queues", type=int)
    p.add_argument("-w", "--write-queues", type=int)
    p.add_argument("-p", "--perm", type=int)
    _admin(sub, "queryMsgById", cmd_query_by_id, "query by offsetMsgId").add_argument("-i", "--msg-id", required=True)
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
PASSTHROUGH = {"controller": cmd_controller, "pipeline": cmd_pipeline}


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        if not args.admin:
            return args.fn(args)
        doc, text = args.fn(args)
    except CliError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n" if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
