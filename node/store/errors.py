"""Exceptions for the world (bugs are asserts). Each says whether a retry may help."""

from __future__ import annotations

import errno


class StoreError(Exception):
    """Base of store errors. `code` is the REST error code; `retriable` says whether to retry."""

    code = "STORE_ERROR"
    retriable = False
    http_status = 500


class InvalidMessage(StoreError):
    code = "INVALID_MESSAGE"
    http_status = 400


class CorruptRecord(StoreError):
    """A record on disk or on the wire fails its checks at `offset`."""

    code = "CORRUPT_RECORD"

    def __init__(self, offset: int, reason: str):
        super().__init__(f"corrupt record at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class DiskFull(StoreError):
    """Writes are refused: the disk is above its hard limit or returned ENOSPC."""

    code = "SERVICE_NOT_AVAILABLE"
    retriable = True
    http_status = 507


class StoreFatal(StoreError):
    """An fsync or write failed: the store cannot know what is durable and stops (fsyncgate)."""

    code = "STORE_FATAL"
    http_status = 503


class NotLeader(StoreError):
    """This node cannot accept writes; `leader` names who can, if known."""

    code = "NOT_LEADER"
    retriable = True
    http_status = 421

    def __init__(self, message: str = "this node is not the leader", leader: str | None = None):
        super().__init__(message)
        self.leader = leader


class FlushTimeout(StoreError):
    code = "FLUSH_DISK_TIMEOUT"
    retriable = True
    http_status = 504


# --- request errors: raised by the broker (node/broker.py) and its services on bad or unservable
# requests, never by the store. They live here so that every REST error code is in one module.
class BadRequest(StoreError):
    code = "BAD_REQUEST"
    http_status = 400


class TopicNotExist(StoreError):
    code = "TOPIC_NOT_EXIST"
    http_status = 404


class MessageNotFound(StoreError):
    code = "NO_MESSAGE"
    http_status = 404


class MessageTooLarge(StoreError):
    code = "MESSAGE_TOO_LARGE"
    http_status = 413


class NoPermission(StoreError):
    code = "NO_PERMISSION"
    http_status = 403


class ApplyTimeout(StoreError):
    """The record was appended but not applied in time; retrying the same commit is safe."""

    code = "SYSTEM_BUSY"
    retriable = True
    http_status = 503


def is_enospc(e: BaseException) -> bool:
    """A write that failed for want of space: the OSError itself, or the one a store error wraps."""
    for err in (e, e.__cause__):
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
    return False
