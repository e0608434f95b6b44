"""Network namespaces, veth pairs and one bridge for a drill cluster on one host (root only).

    root namespace:  bridge mqnb<tag>  10.213.N.1/24   (the drill's workload talks from here)
                       |-- veth mqnv<tag><svc>  <->  eth0 in namespace mqnd-<tag>-<svc>  10.213.N.<host>/24

Every name carries the prefix (`mqnd-`, `mqnb`, `mqnv`, `mqnp`, iptables comment `mqnetns-`,
tmpfs mounts under a `mqstore-netns-` work dir)
and a tag `<pid>x<k>` of the process that made it, so cleanup removes only what this process
made, and `clean_leftovers` removes only what a process that is gone made.

With br_netfilter loaded (Docker loads it), bridged frames pass the root FORWARD chain, whose
policy Docker sets to DROP; one ACCEPT rule for our bridge (commented with our tag) lets the
namespaces talk. Faults are iptables rules inside a node's own namespace: they vanish with it.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile

NS_PREFIX = "mqnd-"
BRIDGE_PREFIX = "mqnb"
VETH_PREFIX = "mqnv"
PEER_PREFIX = "mqnp"
RULE_PREFIX = "mqnetns-"
WORKDIR_PREFIX = "mqstore-netns-"    # the cluster's temporary work dir: <tmp>/mqstore-netns-<tag>-XXXX
SUBNET_BASE = "10.213"              # 10.213.N.0/24, N picked free per cluster
CMD_TIMEOUT_S = 15.0
_counter = itertools.count()


class NetnsError(RuntimeError):
    """A namespace command failed, or this host cannot make namespaces; the message says which."""


def sh(*argv: str, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsError(f"`{argv[0]}` is not installed (apt-get install -y iproute2 iptables)") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(argv)}` did not finish in {timeout:.0f} s") from None
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
    return r


def preflight() -> None:
    """Raise NetnsError saying why namespaces cannot be made here (not root, no ip/iptables, no netns)."""
    if os.geteuid() != 0:
        raise NetnsError("the netns tier needs root (ip netns, veth, iptables); run as root or use the docker tier")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            raise NetnsError(f"`{tool}` is not installed (apt-get install -y iproute2 iptables)")
    probe = f"{NS_PREFIX}{os.getpid()}x{next(_counter)}-probe"
    sh("ip", "netns", "add", probe)
    try:
        sh("ip", "netns", "exec", probe, "iptables", "-S", "INPUT")
    finally:
        sh("ip", "netns", "del", probe, check=False)


def new_tag() -> str:
    k = next(_counter) % 10          # keeps interface names within 15 characters
    return f"{os.getpid()}x{k}"


def _pid_of_tag(tag: str) -> int | None:
    m = re.match(r"(\d+)x\d$", tag)
    return int(m.group(1)) if m else None


def pick_subnet(tag: str) -> str:
    """'10.213.N' for an N no route or address of this host uses yet."""
    used = sh("ip", "-4", "-o", "addr").stdout + sh("ip", "-4", "route").stdout
    pid = _pid_of_tag(tag) or 0
    start = (pid * 10 + int(tag.rsplit("x", 1)[1])) % 250
    for i in range(250):
        n = 1 + (start + i) % 250
        if f"{SUBNET_BASE}.{n}." not in used:
            return f"{SUBNET_BASE}.{n}"
    raise NetnsError(f"every {SUBNET_BASE}.N.0/24 is in use on this host; run `python -m deploy.drills --tier netns clean`")


class Net:
    """One bridge and one namespace per service. `up()` builds, `down()` removes (idempotent)."""

    def __init__(self, tag: str, subnet: str, hosts: dict[str, int]):
        self.tag = tag
        self.subnet = subnet
        self.hosts = dict(hosts)                     # service -> last octet
        self.bridge = f"{BRIDGE_PREFIX}{tag}"
        self.gateway = f"{subnet}.1"
        self.rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-m", "comment",
                     "--comment", f"{RULE_PREFIX}{tag}", "-j", "ACCEPT"]
        self.made: list[tuple[str, str]] = []        # what exists, for down(), newest last

    def ns(self, service: str) -> str:
        return f"{NS_PREFIX}{self.tag}-{service}"

    def ip(self, service: str) -> str:
        return f"{self.subnet}.{self.hosts[service]}"

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("bridge", self.bridge))
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        clash = [ln for ln in sh("ip", "-4", "-o", "addr").stdout.splitlines()
                 if f" {self.subnet}." in ln and f" {self.bridge} " not in ln]
        if clash:            # another run took the same /24 between pick_subnet and here
            raise NetnsError(f"subnet {self.subnet}.0/24 is also on {clash[0].split()[1]}; try again")
        sh("ip", "link", "set", self.bridge, "up")
        sh("iptables", "-I", *self.rule[:1], "1", *self.rule[1:])
        self.made.append(("rule", ""))
        for s in self.hosts:
            ns, host_if, peer_if = self.ns(s), f"{VETH_PREFIX}{self.tag}{s}", f"{PEER_PREFIX}{self.tag}{s}"
            sh("ip", "netns", "add", ns)
            self.made.append(("ns", ns))
            sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
            self.made.append(("link", host_if))
            sh("ip", "link", "set", peer_if, "netns", ns)
            sh("ip", "-n", ns, "link", "set", peer_if, "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(s)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "set", host_if, "master", self.bridge)
            sh("ip", "link", "set", host_if, "up")

    def down(self) -> list[str]:
        """Remove everything up() made, newest first; returns what could not be removed."""
        errors = []
        while self.made:
            kind, name = self.made.pop()
            if kind == "ns":
                kill_ns_pids(name)
                r = sh("ip", "netns", "del", name, check=False)
            elif kind == "link":
                if sh("ip", "link", "show", name, check=False).returncode != 0:
                    continue                           # went with its namespace
                r = sh("ip", "link", "del", name, check=False)
            elif kind == "rule":
                r = sh("iptables", "-D", *self.rule, check=False)
            else:
                r = sh("ip", "link", "del", name, check=False)
            if r.returncode != 0:
                errors.append(f"{kind} {name}: {r.stderr.strip()}")
        return errors

    # --- iptables inside a namespace --------------------------------------------------------
    def iptables(self, service: str, *args: str) -> None:
        sh("ip", "netns", "exec", self.ns(service), "iptables", *args)


def kill_ns_pids(ns: str) -> list[int]:
    """SIGKILL every process still inside namespace `ns` (ours by its name); their PIDs."""
    r = sh("ip", "netns", "pids", ns, check=False)
    pids = [int(x) for x in r.stdout.split() if x.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(include_live: bool = False) -> list[str]:
    """Remove namespaces, links and FORWARD rules with our prefixes whose making process is gone
    (or every one of ours with include_live). Returns what was removed."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        tag = name[len(NS_PREFIX):].split("-", 1)[0]
        if include_live or not _alive(_pid_of_tag(tag)):
            kill_ns_pids(name)
            if sh("ip", "netns", "del", name, check=False).returncode == 0:
                removed.append(f"netns {name}")
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if not m:
            continue
        name = m.group(1)
        for prefix in (BRIDGE_PREFIX, VETH_PREFIX, PEER_PREFIX):
            if name.startswith(prefix):
                tag = re.match(r"(\d+x\d)", name[len(prefix):])
                if tag and (include_live or not _alive(_pid_of_tag(tag.group(1)))):
                    if sh("ip", "link", "del", name, check=False).returncode == 0:
                        removed.append(f"link {name}")
                break
    with open("/proc/mounts") as f:                    # broker-b's small tmpfs stores
        mounts = [ln.split()[1] for ln in f if ln.startswith("tmpfs ")]
    for path in mounts:
        m = re.search(rf"/{WORKDIR_PREFIX}(\d+x\d)-", path)
        if m and (include_live or not _alive(_pid_of_tag(m.group(1)))):
            if sh("umount", "-l", path, check=False).returncode == 0:
                removed.append(f"tmpfs {path}")
    tmp = tempfile.gettempdir()                         # work dirs (logs, stores) of runs that died
    for name in sorted(os.listdir(tmp)):
        m = re.match(rf"{WORKDIR_PREFIX}(\d+x\d)-", name)
        path = os.path.join(tmp, name)
        if m and os.path.isdir(path) and not os.path.ismount(path) and (
                include_live or not _alive(_pid_of_tag(m.group(1)))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"work dir {path}")
    for line in sh("iptables", "-S", "FORWARD", check=False).stdout.splitlines():
        m = re.search(rf"--comment\s+\"?{RULE_PREFIX}(\d+x\d)", line)
        if m and line.startswith("-A ") and (include_live or not _alive(_pid_of_tag(m.group(1)))):
            if sh("iptables", "-D", *_split_rule(line[3:]), check=False).returncode == 0:
                removed.append(f"iptables rule {line}")
    return removed


def _split_rule(spec: str) -> list[str]:
    import shlex
    return shlex.split(spec)
