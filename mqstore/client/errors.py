"""Client exceptions. `retriable` says whether sending again (maybe elsewhere) may help."""

from __future__ import annotations

import json


class MQClientError(Exception):
    """Base of every error the client raises."""

    retriable = False


class MQBrokerError(MQClientError):
    """The broker answered with an error document `{"error", "message", "retriable", "leader"}`."""

    def __init__(self, code: str, message: str, retriable: bool = False, leader: str | None = None,
                 http_status: int = 0, addr: str = ""):
        super().__init__(f"{code}: {message} (broker {addr}, HTTP {http_status})")
        self.code = code
        self.message = message
        self.retriable = bool(retriable)
        self.leader = leader
        self.http_status = http_status
        self.addr = addr


class MQConnectError(MQClientError):
    """No node of a broker group could be reached (or none answered as leader) in time."""

    retriable = True


class MQConfigError(MQClientError, ValueError):
    """A client setting or argument is invalid; the message names it."""


def not_leader_hint(body: bytes) -> str | None:
    """The `leader` of a NOT_LEADER error body, if it is one and names a node (host:port)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.get("error") == "NOT_LEADER" and isinstance(doc.get("leader"), str):
        return doc["leader"] or None
    return None
