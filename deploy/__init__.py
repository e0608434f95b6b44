"""Deployment: image, compose cluster, failover drills."""
