"""Drill tier without Docker: node processes in network namespaces on one host (see cluster.py)."""
