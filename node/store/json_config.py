"""Atomic JSON files under `<store_root>/config/` (RocketMQ's ConfigManager).

Each save writes `<name>.bak` with the previous good content, then replaces `<name>`
atomically (temp, fsync, rename, fsync dir). Load:
- `<name>` missing -> `<name>.bak` if present, else empty (a fresh store);
- `<name>` corrupt -> logged, `<name>.bak` used if it is good;
- both unusable -> `ConfigCorrupt`: starting with empty offsets or topics would
  silently rewind consumers or lose topics, so a human must look.

`TopicConfigTable` is `topics.json` (`{"topicConfigTable": {...}, "dataVersion": {...}}`);
`ConsumerOffsetTable` is `consumerOffset.json` (`{"offsetTable": {"topic@group": {"qid": offset}}}`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from node.store.errors import StoreError
from node.store.fileio import FileSystem

log = logging.getLogger(__name__)

PERM_PRIORITY = 0x8
PERM_READ = 0x4
PERM_WRITE = 0x2
PERM_INHERIT = 0x1
TOPICS_FILE = "topics.json"
OFFSETS_FILE = "consumerOffset.json"
MAX_CONFIG_BYTES = 256 * 1024 * 1024     # refuse to parse anything bigger: it is not ours


class ConfigCorrupt(StoreError):
    """A config file and its .bak are both unreadable: the node must not start on guesses."""

    code = "CONFIG_CORRUPT"
    http_status = 500


class JsonFile:
    """One JSON document written atomically with a .bak of the previous version."""

    def __init__(self, fs: FileSystem, store_root: str, name: str):
        self.fs = fs
        self.directory = os.path.join(store_root, "config")
        self.path = os.path.join(self.directory, name)
        self.bak_path = self.path + ".bak"

    def _read(self, path: str) -> dict[str, Any]:
        raw = self.fs.read_file(path)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"{len(raw)} bytes is over the {MAX_CONFIG_BYTES}-byte limit")
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError(f"top level is {type(doc).__name__}, expected an object")
        return doc

    def load(self) -> dict[str, Any] | None:
        """The document, or None for a fresh store. Raises ConfigCorrupt (see module doc)."""
        problem = None
        if self.fs.exists(self.path):
            try:
                return self._read(self.path)
            except (ValueError, UnicodeDecodeError) as e:
                problem = f"{self.path} is corrupt: {e}"
                log.error("%s; trying %s", problem, self.bak_path)
        if not self.fs.exists(self.bak_path):
            if problem:
                raise ConfigCorrupt(f"{problem}, and there is no {self.bak_path} to fall back to")
            return None
        try:
            doc = self._read(self.bak_path)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigCorrupt(f"{problem or f'{self.path} is missing'}, and {self.bak_path} is corrupt too: {e}") from e
        log.warning("loaded %s from %s", self.path, self.bak_path)
        return doc

    def save(self, doc: dict[str, Any]) -> None:
        text = json.dumps(doc, indent=2, sort_keys=True).encode("utf-8")
        self.fs.makedirs(self.directory)
        if self.fs.exists(self.path):
            current = self.fs.read_file(self.path)
            try:
                json.loads(current.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                current = b""       # never let a corrupt file overwrite a good .bak
            if current:
                self.fs.write_atomic(self.bak_path, current)
        self.fs.write_atomic(self.path, text)


@dataclass(frozen=True, slots=True)
class TopicConfig:
    topicName: str
    readQueueNums: int = 8
    writeQueueNums: int = 8
    perm: int = PERM_READ | PERM_WRITE      # 6, RocketMQ's default
    order: bool = False

    def __post_init__(self) -> None:
        if self.readQueueNums < 0 or self.writeQueueNums < 0:
            raise ValueError(f"topic {self.topicName}: queue counts must be >= 0")


class TopicConfigTable:
    """topics.json: topic -> TopicConfig, with RocketMQ's dataVersion."""

    def __init__(self, fs: FileSystem, store_root: str, clock: Callable[[], float] = time.time):
        self._file = JsonFile(fs, store_root, TOPICS_FILE)
        self._clock = clock
        self._topics: dict[str, TopicConfig] = {}
        self.data_version = {"timestamp": 0, "counter": 0}

    @property
    def path(self) -> str:
        return self._file.path

    def load(self) -> int:
        doc = self._file.load() or {}
        try:
            table = doc.get("topicConfigTable", {})
            self._topics = {name: TopicConfig(**{**cfg, "topicName": name}) for name, cfg in table.items()}
            self.data_version = dict(doc.get("dataVersion", self.data_version))
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigCorrupt(f"{self._file.path}: bad topicConfigTable: {e}") from e
        return len(self._topics)

    def get(self, topic: str) -> TopicConfig | None:
        return self._topics.get(topic)

    def all(self) -> dict[str, TopicConfig]:
        return dict(self._topics)

    def put(self, cfg: TopicConfig) -> None:
        self._topics[cfg.topicName] = cfg
        self._persist()

    def delete(self, topic: str) -> bool:
        if self._topics.pop(topic, None) is None:
            return False
        self._persist()
        return True

    def _persist(self) -> None:
        self.data_version = {"timestamp": int(self._clock() * 1000),
                             "counter": int(self.data_version.get("counter", 0)) + 1}
        self._file.save({"topicConfigTable": {n: asdict(c) for n, c in sorted(self._topics.items())},
                         "dataVersion": self.data_version})


class ConsumerOffsetTable:
    """consumerOffset.json: committed offsets per topic@group and queue id.

    commit() only updates memory (RocketMQ persists every flushConsumerOffsetInterval);
    persist() writes the file if anything changed.
    """

    def __init__(self, fs: FileSystem, store_root: str):
        self._file = JsonFile(fs, store_root, OFFSETS_FILE)
        self._table: dict[str, dict[int, int]] = {}
        self.dirty = False

    @property
    def path(self) -> str:
        return self._file.path

    @staticmethod
    def key(topic: str, group: str) -> str:
        return f"{topic}@{group}"

    def load(self) -> int:
        doc = self._file.load() or {}
        try:
            table = doc.get("offsetTable", {})
            self._table = {k: {int(q): int(o) for q, o in v.items()} for k, v in table.items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigCorrupt(f"{self._file.path}: bad offsetTable: {e}") from e
        self.dirty = False
        return len(self._table)

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        if offset < 0 or queue_id < 0:
            raise ValueError(f"offset and queue id must be >= 0, got {offset} and {queue_id}")
        self._table.setdefault(self.key(topic, group), {})[queue_id] = offset
        self.dirty = True

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """Committed offset, or -1 if none (RocketMQ's queryOffset)."""
        return self._table.get(self.key(topic, group), {}).get(queue_id, -1)

    def offsets(self, group: str, topic: str) -> dict[int, int]:
        return dict(self._table.get(self.key(topic, group), {}))

    def groups_of(self, topic: str) -> list[str]:
        return sorted(k.split("@", 1)[1] for k in self._table if k.split("@", 1)[0] == topic)

    def topics_of(self, group: str) -> list[str]:
        return sorted(k.split("@", 1)[0] for k in self._table if k.split("@", 1)[1] == group)

    def remove_topic(self, topic: str) -> None:
        for k in [k for k in self._table if k.split("@", 1)[0] == topic]:
            del self._table[k]
            self.dirty = True

    def table(self) -> dict[str, dict[int, int]]:
        return {k: dict(v) for k, v in self._table.items()}

    def persist(self, force: bool = False) -> bool:
        if not (self.dirty or force):
            return False
        self._file.save({"offsetTable": {k: {str(q): o for q, o in sorted(v.items())}
                                         for k, v in sorted(self._table.items())}})
        self.dirty = False
        return True
