"""DLedger-mode replication: the sans-IO Raft core (core.py), its messages,
quorum math and storage seam; the entry store, transport and asyncio shell."""
