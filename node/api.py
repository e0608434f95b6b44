"""The node's HTTP API (aiohttp): DESIGN section 6's REST table, JSON and msgpack.

Requests are JSON unless `Content-Type: application/x-msgpack`; responses are JSON
unless `Accept` names application/x-msgpack. Both carry the same shapes, except that
in JSON a message body is a UTF-8 string in `body` or base64 in `body_b64`, while
msgpack carries raw bytes in `body`. Every failure answers
`{"error", "message", "retriable", "leader"}` with a 4xx/5xx status; a request that
fails its checks changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
from typing import Any, Awaitable, Callable

import msgpack
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from node.broker import Broker, OutgoingMessage, PullResult
from node import auth, dashboard, limits
from node.config import to_properties
from node.metrics import node_registry
from node.client_api import CLIENT_ROUTES
from node.openapi import openapi_document
from node.store.cold_reads import read_without_stalling
from node.store.errors import BadRequest, StoreError
from node.store.message import PROPERTY_KEYS, PROPERTY_TAGS, StoredMessage, encode_offset_msg_id, host_bytes
from node.store.message import PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX as PROPERTY_UNIQ_KEY

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
JSON = "application/json"
BROKER_KEY: web.AppKey[Broker] = web.AppKey("broker", Broker)
REGISTRY_KEY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)


# --- encoding ---------------------------------------------------------------------------------
def wants_msgpack(request: web.Request) -> bool:
    return MSGPACK in request.headers.get("Accept", "")


def reply(request: web.Request, doc: Any, status: int = 200) -> web.Response:
    if wants_msgpack(request):
        return web.Response(body=msgpack.packb(doc, use_bin_type=True), status=status, content_type=MSGPACK)
    return web.Response(text=json.dumps(doc, separators=(",", ":")), status=status, content_type=JSON)


async def read_doc(request: web.Request) -> dict[str, Any]:
    """The request body as a map; 400 if it is not well-formed JSON/msgpack or not a map."""
    raw = await request.read()   # aiohttp enforces client_max_size here (413)
    if request.content_type == MSGPACK:
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        # TypeError: a map key msgpack cannot hash (an array or a map).
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise BadRequest(f"malformed msgpack body: {e}") from None
    else:
        try:
            doc = json.loads(raw)   # bytes: json detects UTF-8 itself, no decoded copy
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be an object, got {type(doc).__name__}")
    return doc


@functools.lru_cache(maxsize=1024)
def _offset_id_prefix(store_host: str) -> str:
    """The first 16 hex digits of an offsetMsgId (store ip and port) of `ip:port`."""
    ip, _, port = store_host.rpartition(":")
    return encode_offset_msg_id(host_bytes(ip), int(port), 0)[:16]


def offset_msg_id_of(m: StoredMessage) -> str:
    """m.offset_msg_id, without re-encoding the host part for every message of a pull."""
    if m.physical_offset < 0:
        return m.offset_msg_id
    return _offset_id_prefix(m.store_host) + format(m.physical_offset, "016X")


def render_message(m: StoredMessage, binary: bool) -> dict[str, Any]:
    props = m.properties
    offset_id = offset_msg_id_of(m)   # computed once: msg_id falls back to it
    doc: dict[str, Any] = {
        "msg_id": props.get(PROPERTY_UNIQ_KEY) or offset_id, "offset_msg_id": offset_id, "topic": m.topic,
        "queue_id": m.queue_id, "queue_offset": m.queue_offset, "commitlog_offset": m.physical_offset,
        "tags": props.get(PROPERTY_TAGS), "keys": m.keys if PROPERTY_KEYS in props else [], "properties": props,
        "born_timestamp": m.born_timestamp,
        "store_timestamp": m.store_timestamp, "born_host": m.born_host, "store_host": m.store_host,
        "reconsume_times": m.reconsume_times, "body_crc": m.body_crc,
    }
    if binary:
        doc["body"] = m.body
    else:
        try:
            doc["body"] = m.body.decode("utf-8")
        except UnicodeDecodeError:
            doc["body_b64"] = base64.b64encode(m.body).decode("ascii")
    return doc


# --- request parsing --------------------------------------------------------------------------
def _body_of(item: dict[str, Any], where: str) -> bytes:
    body, b64 = item.get("body"), item.get("body_b64")
    if (body is None) == (b64 is None):
        raise BadRequest(f"{where}: give exactly one of body and body_b64")
    if b64 is not None:
        if not isinstance(b64, str):
            raise BadRequest(f"{where}.body_b64 must be a base64 string")
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{where}.body_b64 is not valid base64") from None
    elif isinstance(body, str):
        data = body.encode("utf-8")
    elif isinstance(body, bytes):
        data = body
    else:
        raise BadRequest(f"{where}.body must be a string (JSON) or bytes (msgpack)")
    if not data:
        raise BadRequest(f"{where}: the message body is empty")   # RocketMQ Validators rejects it too
    return data


def _keys_of(item: dict[str, Any], where: str) -> list[str]:
    keys = item.get("keys")
    if keys is None:
        return []
    if isinstance(keys, str):
        keys = keys.split()
    if not isinstance(keys, list) or not all(isinstance(k, str) and k and " " not in k for k in keys):
        raise BadRequest(f"{where}.keys must be a string or a list of strings without spaces")
    limits.check_keys(keys, where)   # maxKeysPerMessage
    return keys


def _properties_of(item: dict[str, Any], where: str) -> dict[str, str]:
    props = item.get("properties") or {}
    if not isinstance(props, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in props.items()):
        raise BadRequest(f"{where}.properties must map strings to strings")
    limits.check_properties(props, where)   # count, name and value lengths, encoded total
    return props


def parse_message(item: Any, i: int) -> OutgoingMessage:
    """One element of `messages`, checked. The hot path of a batched send: the common
    shapes (bytes or str body, optional str tags, int queue_id and born_timestamp) are
    checked inline with exact type tests (bool is not an int here); anything else goes
    through the helpers that also word the errors."""
    if type(item) is not dict:
        raise BadRequest(f"messages[{i}] must be an object")
    get = item.get
    body = get("body")
    tb = type(body)
    if tb is bytes and body and "body_b64" not in item:
        data = body
    elif tb is str and body and "body_b64" not in item:
        data = body.encode("utf-8")
    else:
        data = _body_of(item, f"messages[{i}]")
    tags = get("tags")
    if tags is not None and (type(tags) is not str or "||" in tags):
        raise BadRequest(f"messages[{i}].tags must be a string without '||'")
    qid = get("queue_id")
    if qid is not None and type(qid) is not int:
        raise BadRequest(f"messages[{i}].queue_id must be an integer")
    born = get("born_timestamp", 0)
    if type(born) is not int or born < 0:
        raise BadRequest(f"messages[{i}].born_timestamp must be a non-negative integer (ms)")
    keys = _keys_of(item, f"messages[{i}]") if get("keys") is not None else []
    props = _properties_of(item, f"messages[{i}]") if get("properties") else {}
    return OutgoingMessage(data, tags or None, keys, props, qid, born)


_PLAIN_FIELDS = frozenset({"body", "tags", "queue_id", "born_timestamp"})


def parse_messages(items: list[Any]) -> list[OutgoingMessage]:
    """`[parse_message(item, i) ...]` for a batch. An item holding only body, tags, queue_id
    and born_timestamp (a batched producer's shape) is checked in this loop with the very
    tests parse_message makes on those fields; any other item, or one that fails a test,
    goes through parse_message, which accepts it or words the error."""
    out: list[OutgoingMessage] = []
    add = out.append
    plain, new = _PLAIN_FIELDS, OutgoingMessage
    for i, item in enumerate(items):
        if type(item) is dict and item.keys() <= plain:
            body, tags, qid, born = item.get("body"), item.get("tags"), item.get("queue_id"), item.get("born_timestamp", 0)
            tb = type(body)
            if (tb is bytes or tb is str) and body and (tags is None or (type(tags) is str and "||" not in tags)) \
                    and (qid is None or type(qid) is int) and type(born) is int and born >= 0:
                add(new(body if tb is bytes else body.encode("utf-8"), tags or None, [], {}, qid, born))
                continue
        add(parse_message(item, i))
    return out


def query_int(request: web.Request, name: str, default: int | None = None) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name} must be an integer, got {raw!r}") from None


def path_int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from None


# --- handlers ---------------------------------------------------------------------------------
def broker_of(request: web.Request) -> Broker:
    return request.app[BROKER_KEY]


async def health(request: web.Request) -> web.Response:
    doc = broker_of(request).health()
    return reply(request, doc, 200 if doc["status"] == "UP" else 503)


def cluster_doc(b: Broker) -> dict[str, Any]:
    """/cluster: the broker's view plus this node's API address and message rates."""
    in_tps, out_tps = b.traffic.tps()
    return {**b.cluster(), "api": b.config.api_address, "in_tps": in_tps, "out_tps": out_tps,
            "messages_in": b.messages_in}


async def cluster(request: web.Request) -> web.Response:
    return reply(request, cluster_doc(broker_of(request)))


async def cluster_nodes(request: web.Request) -> web.Response:
    """Every member of this node's group (ReplicatedLog.members: the DLedger peers' APIs, or the
    brokers the controller lists for a classic group) with its /cluster document."""
    b = broker_of(request)
    peers = b.log.members()
    peers.setdefault(b.config.node_id, b.config.api_address)
    nodes = await dashboard.gather_nodes(peers, lambda: cluster_doc(b), b.config.node_id,
                                         request.app[dashboard.PEER_CLIENT_KEY])
    return reply(request, {"cluster": b.config.broker_cluster_name, "group": b.config.group,
                           "self": b.config.node_id, "nodes": nodes})


async def create_topic(request: web.Request) -> web.Response:
    doc = await read_doc(request)
    cfg = await broker_of(request).create_topic(doc.get("topic"), doc.get("queues"), doc.get("perm"),
                                                read_queues=doc.get("read_queues"),
                                                write_queues=doc.get("write_queues"))
    return reply(request, cfg.to_dict())


async def list_topics(request: web.Request) -> web.Response:
    return reply(request, {"topics": [c.to_dict() for c in broker_of(request).list_topics()]})


async def topic_status(request: web.Request) -> web.Response:
    b = broker_of(request)
    topic = request.match_info["topic"]
    queues = await read_without_stalling(b.topic_status, topic)
    return reply(request, {**b.topic(topic).to_dict(), "queues": queues})


async def send(request: web.Request) -> web.Response:
    doc = await read_doc(request)
    items = doc.get("messages")
    if not isinstance(items, list):
        raise BadRequest("messages must be a list of message objects")
    b = broker_of(request)
    limits.check_batch(len(items))   # maxBatchMessages
    messages = parse_messages(items)
    rows = await b.send_rows(request.match_info["topic"], messages)
    return reply(request, {"results": [{"status": st, "msg_id": mid, "offset_msg_id": oid, "queue_id": qid,
                                        "queue_offset": qoff} for st, mid, oid, qid, qoff in rows]})


def render_pull(r: PullResult, binary: bool) -> dict[str, Any]:
    return {"status": r.status, "next_offset": r.next_offset, "min_offset": r.min_offset,
            "max_offset": r.max_offset, "messages": [render_message(m, binary) for m in r.messages]}


async def pull(request: web.Request) -> web.Response:
    offset = query_int(request, "offset")
    if offset is None:
        raise BadRequest("query parameter offset is required")
    r = await broker_of(request).pull(request.match_info["topic"], path_int(request, "queue_id"), offset,
                                      query_int(request, "max"), request.query.get("tags"),
                                      query_int(request, "wait_ms", 0), request.query.get("group"))
    return reply(request, render_pull(r, wants_msgpack(request)))


async def search_offset(request: web.Request) -> web.Response:
    ts = query_int(request, "timestamp")
    if ts is None:
        raise BadRequest("query parameter timestamp is required (ms since the epoch)")
    topic, qid = request.match_info["topic"], path_int(request, "queue_id")
    offset = await broker_of(request).search_offset(topic, qid, ts)
    return reply(request, {"topic": topic, "queue_id": qid, "timestamp": ts, "offset": offset})


async def message_by_queue_offset(request: web.Request) -> web.Response:
    m = await read_without_stalling(broker_of(request).query_by_queue_offset, request.match_info["topic"],
                                    path_int(request, "queue_id"), path_int(request, "queue_offset"))
    return reply(request, render_message(m, wants_msgpack(request)))


async def commit_offset(request: web.Request) -> web.Response:
    doc = await read_doc(request)
    group = request.match_info["group"]
    status = await broker_of(request).commit_offset(group, doc.get("topic"), doc.get("queue_id"), doc.get("offset"))
    return reply(request, {"group": group, "topic": doc["topic"], "queue_id": doc["queue_id"],
                           "offset": doc["offset"], "status": status.value})


async def read_offsets(request: web.Request) -> web.Response:
    group = request.match_info["group"]
    table = broker_of(request).get_offsets(group, request.query.get("topic"))
    rows = [{"topic": t, "queue_id": q, "offset": o} for t in sorted(table) for q, o in table[t].items()]
    return reply(request, {"group": group, "offsets": rows})


async def message_by_id(request: web.Request) -> web.Response:
    m = await read_without_stalling(broker_of(request).query_by_id, request.match_info["offset_msg_id"])
    return reply(request, render_message(m, wants_msgpack(request)))


async def messages_by_key(request: web.Request) -> web.Response:
    key = request.query.get("key")
    if key is None:
        raise BadRequest("query parameter key is required (GET on this path queries by key)")
    found = await broker_of(request).query_by_key(request.match_info["topic"], key, query_int(request, "begin", 0),
                                                  query_int(request, "end"), query_int(request, "max", 32))
    return reply(request, {"messages": [render_message(m, wants_msgpack(request)) for m in found]})


async def delete_topic(request: web.Request) -> web.Response:
    cfg = await broker_of(request).delete_topic(request.match_info["topic"])
    return reply(request, {"deleted": cfg.to_dict()})


async def list_groups(request: web.Request) -> web.Response:
    return reply(request, {"groups": broker_of(request).list_groups()})


async def group_progress(request: web.Request) -> web.Response:
    b = broker_of(request)
    group = request.match_info["group"]
    rows = await read_without_stalling(b.group_progress, group, request.query.get("topic"))
    return reply(request, {"group": group, "broker_name": b.config.group, "consume_tps": round(b.traffic.group_tps(group), 2),
                           "diff_total": sum(int(r["diff"]) for r in rows), "queues": rows})


async def stats_all(request: web.Request) -> web.Response:
    b = broker_of(request)
    return reply(request, {"broker_name": b.config.group, "topics": b.stats_all(request.query.get("topic"))})


async def reset_offsets(request: web.Request) -> web.Response:
    ts, topic = query_int(request, "timestamp"), request.query.get("topic")
    if ts is None or not topic:
        raise BadRequest("query parameters topic and timestamp (ms) are required")
    b = broker_of(request)
    group = request.match_info["group"]
    rows = await b.reset_offsets_by_time(group, topic, ts)
    return reply(request, {"group": group, "topic": topic, "timestamp": ts, "broker_name": b.config.group,
                           "queues": rows})


async def get_config(request: web.Request) -> web.Response:
    b = broker_of(request)
    return reply(request, {"broker_name": b.config.group, "api": b.config.api_address,
                           "config": to_properties(b.config)})


async def delete_expired_commitlog(request: web.Request) -> web.Response:
    b = broker_of(request)
    passes = b.delete_expired_manually()
    return reply(request, {"broker_name": b.config.group, "api": b.config.api_address, "manual_delete_passes": passes,
                           "min_offset": b.log.min_physical_offset})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# --- errors -------------------------------------------------------------------------------------
def error_doc(code: str, message: str, retriable: bool = False, leader: str | None = None) -> dict[str, Any]:
    return {"error": code, "message": message, "retriable": retriable, "leader": leader}


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except StoreError as e:
        leader = getattr(e, "leader", None) or broker_of(request).log.leader()
        return reply(request, error_doc(e.code, str(e), e.retriable, leader), e.http_status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "REQUEST_TOO_LARGE"}.get(e.status, "HTTP_ERROR")
        return reply(request, error_doc(code, e.text or e.reason), e.status)
    except Exception:  # noqa: BLE001 - the client gets a 500 with our shape; the log gets the trace
        log.exception("unhandled error in %s %s", request.method, request.path)
        return reply(request, error_doc("INTERNAL_ERROR", "internal error; see the node's log"), 500)


# --- app --------------------------------------------------------------------------------------------
ROUTES: list[tuple[str, str, Callable]] = [
    ("GET", "/health", health),
    ("GET", "/cluster", cluster),
    ("POST", "/topics", create_topic),
    ("GET", "/topics", list_topics),
    ("GET", "/topics/{topic}", topic_status),
    ("POST", "/topics/{topic}/messages", send),
    ("GET", "/topics/{topic}/messages", messages_by_key),
    ("GET", "/topics/{topic}/queues/{queue_id}/messages", pull),
    ("GET", "/topics/{topic}/queues/{queue_id}/messages/{queue_offset}", message_by_queue_offset),
    ("GET", "/topics/{topic}/queues/{queue_id}/offset", search_offset),
    ("POST", "/groups/{group}/offsets", commit_offset),
    ("GET", "/groups/{group}/offsets", read_offsets),
    ("GET", "/messages/{offset_msg_id}", message_by_id),
    ("DELETE", "/topics/{topic}", delete_topic),
    ("GET", "/cluster/nodes", cluster_nodes),
    ("GET", "/groups", list_groups),
    ("GET", "/groups/{group}/progress", group_progress),
    ("POST", "/groups/{group}/offsets/reset", reset_offsets),
    ("GET", "/stats", stats_all),
    ("GET", "/config", get_config),
    ("POST", "/commitlog/delete-expired", delete_expired_commitlog),
    ("GET", "/openapi.json", openapi),
    ("GET", "/metrics", metrics),
]
ROUTES += CLIENT_ROUTES   # delay, transactions, group members, send-back (node/client_api.py)


def make_app(broker: Broker) -> web.Application:
    app = web.Application(client_max_size=broker.config.max_request_bytes,
                          middlewares=[errors, limits.middleware(limits.Limits.from_config(broker.config), broker)])
    auth.install(app, broker.config)   # aclEnable: signed requests and per-account permissions
    app[BROKER_KEY] = broker
    app[REGISTRY_KEY] = node_registry(broker)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    app[dashboard.PEER_CLIENT_KEY] = dashboard.PeerClient.from_config(broker.config)   # https, signed
    dashboard.add_routes(app)
    return app
