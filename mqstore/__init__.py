"""mqstore: what users import and run — the client SDK (`mqstore.client`, re-exported here:
Producer, Consumer, PullConsumer, TransactionProducer, Admin and their asyncio twins) and the
`mqstore` command line (`mqstore.cli`). See docs/client.md."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_CLIENT_NAMES = (
    "Admin", "AsyncAdmin", "AsyncConsumer", "AsyncPullConsumer", "AsyncPushConsumer", "AsyncProducer",
    "AsyncTransactionProducer", "ConsumeFromWhere", "ConsumeStatus", "Consumer", "LatencyFaultTolerance",
    "LocalTransactionState", "MQBrokerError", "MQClientError", "MQConfigError", "MQConnectError", "Message",
    "MessageExt", "MessageModel", "MessageQueue", "Producer", "PullConsumer", "PullResult", "PullStatus",
    "PushConsumer", "SendResult", "SendStatus", "TransactionProducer", "TransactionSendResult",
    "allocate_averagely",
)
__all__ = list(_CLIENT_NAMES)


def __getattr__(name: str) -> Any:
    # Imported on first use, so `mqstore` CLI commands that need no client stay quick to start.
    if name in _CLIENT_NAMES:
        from mqstore import client
        return getattr(client, name)
    raise AttributeError(f"module 'mqstore' has no attribute {name!r}")
