"""`python -m ha.node_launcher -c broker.conf`: the real node with classic HA wired in.

A stopgap until `node.server.build_log` calls `ha.wiring.build_ha_log` itself: it
replaces `build_log`/`build_broker` in node.server, then runs node's own `main`.
"""

from __future__ import annotations

import sys

import node.server as server
from ha.wiring import attach_truncation, build_ha_log

_orig_build_log = server.build_log
_orig_build_broker = server.build_broker


def _build_log(config, fs, checkpoint):
    return build_ha_log(config, fs, checkpoint) or _orig_build_log(config, fs, checkpoint)


def _build_broker(config, fs=None):
    broker = _orig_build_broker(config, fs)
    attach_truncation(broker)
    return broker


def main(argv: list[str] | None = None) -> int:
    server.build_log = _build_log
    server.build_broker = _build_broker
    from node.__main__ import main as node_main
    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
