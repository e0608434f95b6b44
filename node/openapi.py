"""The OpenAPI 3.1 document served at /openapi.json, written by hand to match node/api.py.

tests/unit/test_api.py checks that every route of the app appears here with its method.
"""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema},
                                                    "application/x-msgpack": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": _ERROR_TEXT[c], "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


_ERROR_TEXT = {400: "malformed or invalid input, or a hard limit exceeded (LIMIT_EXCEEDED); nothing changed",
               403: "topic permission forbids it", 429: "too many requests in flight from this client (retriable)",
               404: "unknown topic or message", 413: "request or message too large",
               421: "this node is not the leader (see `leader`)", 503: "store stopped or busy (see `retriable`)",
               504: "flush timeout", 507: "disk full"}


def _param(name: str, where: str, schema_type: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required or where == "path",
            "schema": {"type": schema_type}, "description": description}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema},
                                          "application/x-msgpack": {"schema": schema}}}


TOPIC = _param("topic", "path", "string", "topic name, ^[%|a-zA-Z0-9_-]+$, at most 127 chars")
TOPIC["schema"].update(pattern="^[%|a-zA-Z0-9_-]+$", minLength=1, maxLength=127)   # node/limits.py check_path_names
QUEUE = _param("queue_id", "path", "integer", "queue id, 0 <= queue_id < queue count")
GROUP = _param("group", "path", "string", "consumer group, ^[%|a-zA-Z0-9_-]+$, at most 120 chars")
GROUP["schema"].update(pattern="^[%|a-zA-Z0-9_-]+$", minLength=1, maxLength=120)


def _paths() -> dict[str, Any]:
    return {
        "/health": {"get": {"summary": "Node health", "responses": {"200": _ok(_ref("Health")),
                                                                    "503": _ok(_ref("Health"), "not serving")}}},
        "/cluster": {"get": {"summary": "Roles, terms, commit/applied indexes, HA offsets of the group",
                             "responses": {"200": _ok({"type": "object"})}}},
        "/topics": {
            "post": {"summary": "Create or update a topic (replicated through the log)",
                     "requestBody": _body(_ref("TopicCreate")),
                     "responses": {"200": _ok(_ref("Topic")), **_errors(400, 421, 503)}},
            "get": {"summary": "List topics", "responses": {"200": _ok({"type": "object", "properties": {
                "topics": {"type": "array", "items": _ref("Topic")}}})}}},
        "/topics/{topic}": {"get": {"summary": "Topic config and per-queue min/max offset, last update",
                                    "parameters": [TOPIC],
                                    "responses": {"200": _ok(_ref("TopicStatus")), **_errors(400, 404)}},
                            "delete": {"summary": "Delete a topic: its config, consume queues and consumer offsets "
                                                  "(replicated); its commitlog records age out with retention",
                                       "parameters": [TOPIC],
                                       "responses": {"200": _ok({"type": "object", "properties": {
                                           "deleted": _ref("Topic")}}), **_errors(400, 404, 421, 503)}}},
        "/cluster/nodes": {"get": {"summary": "Every member of this node's group with its /cluster document",
                                   "responses": {"200": _ok({"type": "object"})}}},
        "/groups": {"get": {"summary": "Consumer groups with committed offsets on this node",
                            "responses": {"200": _ok({"type": "object", "properties": {
                                "groups": {"type": "array", "items": {"type": "string"}}}})}}},
        "/groups/{group}/progress": {"get": {
            "summary": "consumerProgress: broker offset, consumer offset, diff and last time per queue",
            "parameters": [GROUP, _param("topic", "query", "string", "only this topic")],
            "responses": {"200": _ok(_ref("GroupProgress")), **_errors(400, 404)}}},
        "/groups/{group}/offsets/reset": {"post": {
            "summary": "resetOffsetByTime: set the group's offset on every queue of a topic to a store time",
            "parameters": [GROUP, _param("topic", "query", "string", "topic", True),
                           _param("timestamp", "query", "integer", "ms; first message stored at or after it "
                                                                          "(-1: the max offset, skipAccumulatedMessage)", True)],
            "responses": {"200": _ok({"type": "object"}), **_errors(400, 404, 421, 503)}}},
        "/stats": {"get": {
            "summary": "statsAll: per topic the messages sent to this node (TPS over the last minute, count over "
                       "the last day); per consumer group of it what it pulled here (the same) and its accumulation",
            "parameters": [_param("topic", "query", "string", "only this topic")],
            "responses": {"200": _ok({"type": "object", "properties": {
                "broker_name": {"type": "string"},
                "topics": {"type": "array", "items": {"type": "object", "properties": {
                    "topic": {"type": "string"}, "in_tps": {"type": "number"}, "in_msg_24h": {"type": "integer"},
                    "groups": {"type": "array", "items": {"type": "object", "properties": {
                        "group": {"type": "string"}, "accumulation": {"type": "integer"},
                        "out_tps": {"type": "number"}, "out_msg_24h": {"type": "integer"}}}}}}}}}),
                **_errors(400, 404)}}},
        "/config": {"get": {"summary": "getBrokerConfig: the node's broker.conf keys and values",
                            "responses": {"200": _ok({"type": "object"})}}},
        "/commitlog/delete-expired": {"post": {
            "summary": "deleteExpiredCommitLog: the next 20 retention passes (the first at once) delete the "
                       "commitlog files older than fileReservedTime at any hour, not only at deleteWhen's",
            "responses": {"200": _ok({"type": "object", "properties": {
                "manual_delete_passes": {"type": "integer"},
                "min_offset": {"type": "integer", "description": "the commitlog's first offset, before the pass"}}})}}},
        "/topics/{topic}/messages": {
            "post": {"summary": "Send messages (one atomic batch); results in order", "parameters": [TOPIC],
                     "requestBody": _body(_ref("SendRequest")),
                     "responses": {"200": _ok({"type": "object", "properties": {
                         "results": {"type": "array", "items": _ref("SendResult")}}}),
                         **_errors(400, 403, 404, 413, 421, 503, 504, 507)}},
            "get": {"summary": "Query messages by key and store-time range (index file)",
                    "parameters": [TOPIC, _param("key", "query", "string", "message key", True),
                                   _param("begin", "query", "integer", "ms, default 0"),
                                   _param("end", "query", "integer", "ms, default now"),
                                   _param("max", "query", "integer", "1..64, default 32")],
                    "responses": {"200": _ok({"type": "object", "properties": {
                        "messages": {"type": "array", "items": _ref("Message")}}}), **_errors(400, 404)}}},
        "/topics/{topic}/queues/{queue_id}/messages": {"get": {
            "summary": "Pull (long polling with wait_ms)",
            "parameters": [TOPIC, QUEUE, _param("offset", "query", "integer", "queue offset to read from", True),
                           _param("max", "query", "integer", "most messages (capped by the broker, 32)"),
                           _param("tags", "query", "string", "`*` or `TagA || TagB`"),
                           _param("wait_ms", "query", "integer", "long-poll time when nothing is new"),
                           _param("group", "query", "string", "the consumer group pulling (counted for statsAll)")],
            "responses": {"200": _ok(_ref("PullResult")), **_errors(400, 403, 404)}}},
        "/topics/{topic}/queues/{queue_id}/messages/{queue_offset}": {"get": {
            "summary": "Query one message by queue offset",
            "parameters": [TOPIC, QUEUE, _param("queue_offset", "path", "integer", "queue offset")],
            "responses": {"200": _ok(_ref("Message")), **_errors(400, 404)}}},
        "/topics/{topic}/queues/{queue_id}/offset": {"get": {
            "summary": "Search a queue offset by store time (RocketMQ searchOffset)",
            "parameters": [TOPIC, QUEUE, _param("timestamp", "query", "integer", "ms since the epoch", True)],
            "responses": {"200": _ok({"type": "object", "properties": {
                "topic": {"type": "string"}, "queue_id": {"type": "integer"},
                "timestamp": {"type": "integer"},
                "offset": {"type": "integer", "description": "the first offset stored at or after the time; "
                                                            "the max offset if none is"}}}),
                **_errors(400, 404)}}},
        "/groups/{group}/offsets": {
            "post": {"summary": "Commit a consumer offset (clustering; replicated through the log)",
                     "parameters": [GROUP], "requestBody": _body(_ref("OffsetCommit")),
                     "responses": {"200": _ok(_ref("OffsetCommitted")), **_errors(400, 404, 421, 503)}},
            "get": {"summary": "Read a group's committed offsets",
                    "parameters": [GROUP, _param("topic", "query", "string", "only this topic")],
                    "responses": {"200": _ok({"type": "object", "properties": {
                        "group": {"type": "string"},
                        "offsets": {"type": "array", "items": _ref("OffsetCommit")}}}), **_errors(400, 404)}}},
        "/messages/{offset_msg_id}": {"get": {
            "summary": "Query one message by offsetMsgId (32 hex chars)",
            "parameters": [_param("offset_msg_id", "path", "string", "store ip 4 + port 4 + commit offset 8, hex")],
            "responses": {"200": _ok(_ref("Message")), **_errors(400, 404)}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OK"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text format"}}}},
        **_client_paths(),
    }


def _client_paths() -> dict[str, Any]:
    """Routes of node/client_api.py: group members, send-back, transactions."""
    obj = {"type": "object"}
    client_id = _param("client_id", "path", "string", "the consumer's client id")
    return {
        "/groups/{group}/heartbeat": {"post": {
            "summary": "A consumer's heartbeat; answers the live members per topic (clients rebalance on it)",
            "parameters": [GROUP], "requestBody": _body(_ref("Heartbeat")),
            "responses": {"200": _ok({"type": "object", "properties": {
                "group": {"type": "string"}, "members": {"type": "object", "additionalProperties": {
                    "type": "array", "items": {"type": "string"}}}}}), **_errors(400, 421)}}},
        "/groups/{group}/members": {"get": {
            "summary": "Live members of a consumer group", "parameters": [GROUP],
            "responses": {"200": _ok(obj), **_errors(400, 421)}}},
        "/groups/{group}/members/{client_id}": {"delete": {
            "summary": "A consumer leaves its group (others rebalance at once)", "parameters": [GROUP, client_id],
            "responses": {"200": _ok(obj), **_errors(400, 421)}}},
        "/groups/{group}/lock": {"post": {
            "summary": "Lock queues for an ordered consumer ({client_id, queues: [{topic, queue_id}]}); answers "
                       "the queues granted or renewed, their lifetime, and retry_after_ms after a leader change",
            "parameters": [GROUP], "requestBody": _body(obj), "responses": {"200": _ok(obj), **_errors(400, 421)}}},
        "/groups/{group}/unlock": {"post": {
            "summary": "Release queue locks this client holds", "parameters": [GROUP], "requestBody": _body(obj),
            "responses": {"200": _ok(obj), **_errors(400, 421)}}},
        "/groups/{group}/locks": {"get": {
            "summary": "Queue locks held in a consumer group", "parameters": [GROUP],
            "responses": {"200": _ok(obj), **_errors(400, 421)}}},
        "/groups/{group}/retry": {"post": {
            "summary": "Send back a message whose consumption failed: to %RETRY%<group> after a delay level, "
                       "or to %DLQ%<group> once reconsume_times passes max_reconsume_times (16)",
            "parameters": [GROUP], "requestBody": _body(_ref("SendBack")),
            "responses": {"200": _ok(_ref("SendBackResult")), **_errors(400, 404, 421, 503)}}},
        "/transactions/end": {"post": {
            "summary": "Commit or roll back a half message (recorded in RMQ_SYS_TRANS_OP_HALF_TOPIC)",
            "requestBody": _body(_ref("EndTransaction")),
            "responses": {"200": _ok(obj), **_errors(400, 404, 421, 503)}}},
        "/transactions/pending": {"get": {
            "summary": "Check-back by polling: undecided half messages of a producer group older than N ms",
            "parameters": [_param("producer_group", "query", "string", "producer group", True),
                           _param("older_than_ms", "query", "integer", "only half messages stored this long ago"),
                           _param("max", "query", "integer", "1..256, default 32")],
            "responses": {"200": _ok({"type": "object", "properties": {
                "messages": {"type": "array", "items": _ref("Message")}}}), **_errors(400, 421, 503)}}},
    }


def _schemas() -> dict[str, Any]:
    integer, string = {"type": "integer"}, {"type": "string"}
    return {
        "Error": {"type": "object", "required": ["error", "message", "retriable"], "properties": {
            "error": string, "message": string, "retriable": {"type": "boolean"},
            "leader": {"type": ["string", "null"]}}},
        "Health": {"type": "object", "properties": {
            "status": {"enum": ["UP", "DOWN"]}, "mode": string, "role": string, "group": string, "node_id": string,
            "term": integer, "leader": string, "committed_offset": integer,
            "stream_port": {"type": "integer", "description": "the produce stream's port (streamListenPort), "
                            "when the node has one: docs/formats.md section 10"}}},
        "TopicCreate": {"type": "object", "required": ["topic"], "properties": {
            "topic": string, "queues": integer, "read_queues": integer, "write_queues": integer,
            "perm": {"type": "integer", "description": "4 read | 2 write, default 6"}}},
        "Topic": {"type": "object", "properties": {"topic": string, "read_queue_nums": integer,
                                                    "write_queue_nums": integer, "perm": integer}},
        "TopicStatus": {"allOf": [_ref("Topic"), {"type": "object", "properties": {"queues": {
            "type": "array", "items": {"type": "object", "properties": {
                "queue_id": integer, "min_offset": integer, "max_offset": integer,
                "last_updated": {"type": "integer", "description": "store time (ms) of the newest message"}}}}}}]},
        "OutgoingMessage": {"type": "object", "properties": {
            "body": {"description": "UTF-8 text (JSON) or bytes (msgpack)"},
            "body_b64": {"type": "string", "description": "base64 body (JSON only); exactly one of body/body_b64"},
            "tags": string, "keys": {"oneOf": [string, {"type": "array", "items": string}]},
            "properties": {"type": "object", "additionalProperties": string}, "queue_id": integer,
            "born_timestamp": integer}},
        "SendRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "items": _ref("OutgoingMessage")}}},
        "SendResult": {"type": "object", "properties": {
            "status": {"enum": ["SEND_OK", "FLUSH_DISK_TIMEOUT", "FLUSH_SLAVE_TIMEOUT", "SLAVE_NOT_AVAILABLE"]},
            "msg_id": string, "offset_msg_id": string, "queue_id": integer, "queue_offset": integer}},
        "Message": {"type": "object", "properties": {
            "msg_id": string, "offset_msg_id": string, "topic": string, "queue_id": integer,
            "queue_offset": integer, "commitlog_offset": integer, "tags": {"type": ["string", "null"]},
            "keys": {"type": "array", "items": string},
            "properties": {"type": "object", "additionalProperties": string},
            "born_timestamp": integer, "store_timestamp": integer, "born_host": string, "store_host": string,
            "reconsume_times": integer, "body_crc": integer,
            "body": {"description": "UTF-8 text (JSON) or bytes (msgpack)"},
            "body_b64": {"type": "string", "description": "JSON only, when the body is not valid UTF-8"}}},
        "PullResult": {"type": "object", "properties": {
            "status": {"enum": ["FOUND", "NO_NEW_MSG", "NO_MATCHED_MSG", "OFFSET_ILLEGAL"]},
            "next_offset": integer, "min_offset": integer, "max_offset": integer,
            "messages": {"type": "array", "items": _ref("Message")}}},
        "GroupProgress": {"type": "object", "properties": {
            "group": string, "broker_name": string, "consume_tps": {"type": "number"}, "diff_total": integer,
            "queues": {"type": "array", "items": {"type": "object", "properties": {
                "topic": string, "queue_id": integer, "broker_offset": integer, "consumer_offset": integer,
                "diff": integer, "last_timestamp": integer}}}}},
        "Heartbeat": {"type": "object", "required": ["client_id", "topics"], "properties": {
            "client_id": string, "topics": {"type": "array", "items": string},
            "ttl_ms": {"type": "integer", "description": "membership expires this long after the beat (1000..300000)"},
            "subscriptions": {"type": "object", "additionalProperties": string,
                              "description": "topic (of `topics`) -> expression, for consumerConnection"},
            "consume_type": {"type": "string", "enum": ["CONSUME_PASSIVELY", "CONSUME_ACTIVELY"]},
            "message_model": {"type": "string", "enum": ["CLUSTERING", "BROADCASTING"]},
            "consume_from_where": {"type": "string", "enum": ["CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET",
                                                              "CONSUME_FROM_TIMESTAMP"]},
            "language": {"type": "string", "maxLength": 32}, "version": {"type": "string", "maxLength": 32}}},
        "SendBack": {"type": "object", "required": ["offset_msg_id"], "properties": {
            "offset_msg_id": string,
            "delay_level": {"type": "integer", "description": "0: 3 + reconsume_times; -1: straight to the DLQ"},
            "max_reconsume_times": {"type": "integer", "description": "default 16"}}},
        "SendBackResult": {"type": "object", "properties": {
            "status": string, "topic": string, "reconsume_times": integer, "delay_level": integer,
            "msg_id": string}},
        "EndTransaction": {"type": "object", "required": ["producer_group", "offset_msg_id", "action"],
                           "properties": {"producer_group": string, "offset_msg_id": string,
                                          "action": {"enum": ["COMMIT", "ROLLBACK"]}}},
        "OffsetCommit": {"type": "object", "required": ["topic", "queue_id", "offset"], "properties": {
            "group": string, "topic": string, "queue_id": integer, "offset": integer}},
        # The commit's put status: SEND_OK, or on a SYNC_MASTER stored and applied on the
        # master with its replication not confirmed (FLUSH_SLAVE_TIMEOUT, SLAVE_NOT_AVAILABLE).
        "OffsetCommitted": {"type": "object", "required": ["group", "topic", "queue_id", "offset", "status"],
                            "properties": {"group": string, "topic": string, "queue_id": integer,
                                           "offset": integer, "status": {"enum": [
                                               "SEND_OK", "FLUSH_DISK_TIMEOUT", "FLUSH_SLAVE_TIMEOUT",
                                               "SLAVE_NOT_AVAILABLE"]}}},
    }


def openapi_document() -> dict[str, Any]:
    return {"openapi": "3.1.0",
            "info": {"title": "mqstore node API", "version": "0.1.0",
                     "description": "RocketMQ-style message store node: JSON for people, msgpack for clients."},
            "paths": _paths(), "components": {"schemas": _schemas()}}
