"""Deterministic simulation of a DLedger Raft group: one seed drives it all."""
