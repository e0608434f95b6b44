"""Failover drills against the docker-compose cluster (`mqstore drill`, `make drill`)."""
