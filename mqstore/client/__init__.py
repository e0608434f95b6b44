"""The mqstore client SDK: producers, consumers and admin over HTTP + msgpack.

Synchronous clients (`Producer`, `Consumer`, `PullConsumer`, `TransactionProducer`, `Admin`)
wrap the asyncio ones (`AsyncProducer`, `AsyncConsumer`, ...) on a private loop thread.
See docs/client.md.
"""

from mqstore.client.admin import AsyncAdmin
from mqstore.client.consumer import AsyncConsumer, AsyncPullConsumer, allocate_averagely
from mqstore.client.errors import MQBrokerError, MQClientError, MQConfigError, MQConnectError
from mqstore.client.message import (ConsumeFromWhere, ConsumeStatus, LocalTransactionState, Message, MessageExt,
                                    MessageModel, MessageQueue, PullResult, PullStatus, SendResult, SendStatus,
                                    TransactionSendResult)
from mqstore.client.producer import AsyncProducer, LatencyFaultTolerance
from mqstore.client.sync import Admin, Consumer, Producer, PullConsumer, TransactionProducer
from mqstore.client.transaction import AsyncTransactionProducer

AsyncPushConsumer = AsyncConsumer
PushConsumer = Consumer

__all__ = [
    "Admin", "AsyncAdmin", "AsyncConsumer", "AsyncPullConsumer", "AsyncPushConsumer", "AsyncProducer",
    "AsyncTransactionProducer", "ConsumeFromWhere", "ConsumeStatus", "Consumer", "LatencyFaultTolerance",
    "LocalTransactionState", "MQBrokerError", "MQClientError", "MQConfigError", "MQConnectError", "Message",
    "MessageExt", "MessageModel", "MessageQueue", "Producer", "PullConsumer", "PullResult", "PullStatus",
    "PushConsumer", "SendResult", "SendStatus", "TransactionProducer", "TransactionSendResult",
    "allocate_averagely",
]
