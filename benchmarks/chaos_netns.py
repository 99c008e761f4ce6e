"""Network faults for the chaos benchmark, confined to a network namespace it makes itself.

The link faults (`slow_link`, `partition`) change how packets flow between nodes, so the
whole benchmark — Ray, nodes, metadata service, router, load — runs inside a private network
namespace with only its own loopback (`run_in_private_netns`: it runs the same command again
under `unshare --net`, and returns that run's JSON). Nothing outside it is touched: its `lo`
and its packet filter exist only for the processes started inside, and vanish with them.

The link between nodes is their KV traffic: every TCP port a node process listens on
except its request socket and its metrics port (`kv_ports`: the KV side channel and
Mooncake's handshake and data ports), matched as source or destination, so node-to-node
transfers and prefix pulls are hit while the router's and the metadata service's traffic is
not. `LinkFault` drops packets there with iptables' `statistic` match (loss), or all of them
(a partition), and adds delay with `tc netem` when the kernel has it (`netem_available`);
this benchmark's machines have been seen with and without CONFIG_NET_SCH_NETEM.

API: `IN_NETNS_ENV`, `in_private_netns`, `run_in_private_netns`, `kv_ports`, `LinkFault`,
`netem_available`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from urllib.parse import urlsplit

IN_NETNS_ENV = "PDCLUSTER_CHAOS_NETNS"
_MULTIPORT_MAX = 15  # ports per iptables multiport match


def in_private_netns() -> bool:
    return os.environ.get(IN_NETNS_ENV) == "1"


def run_in_private_netns(cli_args: list[str], timeout_s: float) -> dict:
    """`pdcluster <cli_args>` (a benchmark printing its JSON last) inside a fresh network
    namespace with loopback up; its JSON result."""
    missing = [tool for tool in ("unshare", "ip", "iptables") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        raise RuntimeError("the link faults need root and unshare, ip and iptables (Debian: "
                           f"util-linux, iproute2, iptables) to make their own network "
                           f"namespace; missing: {missing or 'root'}")
    command = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
               sys.executable, "-m", "pdcluster.cluster.cli", *cli_args]
    done = subprocess.run(command, env={**os.environ, IN_NETNS_ENV: "1"}, timeout=timeout_s,
                          stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the benchmark in its network namespace failed (status "
                           f"{done.returncode})")
    return json.loads(lines[-1])


def _port(address: str) -> int | None:
    return urlsplit(address).port if address else None


def kv_ports(nodes: list[dict[str, str]], pids: dict[str, int]) -> list[int]:
    """Every port the node processes listen on, but their request and metrics ports."""
    import psutil

    skip = {_port(n["request_address"]) for n in nodes} | {
        _port(n.get("metrics_address", "")) for n in nodes}
    ports: set[int] = set()
    for pid in pids.values():
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port not in skip:
                ports.add(conn.laddr.port)
    return sorted(ports)


def netem_available() -> bool:
    probe = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "9:",
                            "netem", "delay", "1ms"], capture_output=True)
    if probe.returncode == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return probe.returncode == 0


class LinkFault:
    """Packet loss, drop-all and delay on the given ports of this namespace's loopback."""

    def __init__(self, ports: list[int]) -> None:
        if not in_private_netns():
            raise RuntimeError("refusing to change packet filters outside the benchmark's own "
                               "network namespace")
        if not ports:
            raise ValueError("no node ports to fault")
        self.ports = ports
        self._rules: list[list[str]] = []
        self._netem = False

    def drop(self, probability: float = 1.0) -> None:
        """Drop packets to or from the ports, each with `probability` (1: a partition)."""
        chance = [] if probability >= 1 else [
            "-m", "statistic", "--mode", "random", "--probability", f"{probability:g}"]
        for i in range(0, len(self.ports), _MULTIPORT_MAX):
            chunk = ",".join(map(str, self.ports[i:i + _MULTIPORT_MAX]))
            for direction in ("--dports", "--sports"):
                rule = ["INPUT", "-p", "tcp", "-m", "multiport", direction, chunk, *chance,
                        "-j", "DROP"]
                subprocess.run(["iptables", "-A", *rule], check=True)
                self._rules.append(rule)

    def delay(self, ms: int) -> bool:
        """Delay every packet to or from the ports by `ms`; False where netem is missing."""
        if not netem_available():
            return False
        tc = ["tc", "qdisc", "add", "dev", "lo"]
        subprocess.run([*tc, "root", "handle", "1:", "prio"], check=True)
        subprocess.run([*tc, "parent", "1:3", "handle", "30:", "netem", "delay", f"{ms}ms"],
                       check=True)
        for port in self.ports:
            for field in ("dport", "sport"):
                subprocess.run(["tc", "filter", "add", "dev", "lo", "parent", "1:0",
                                "protocol", "ip", "u32", "match", "ip", field, str(port),
                                "0xffff", "flowid", "1:3"], check=True)
        self._netem = True
        return True

    def packets_dropped(self) -> int:
        """Packets this fault's rules dropped so far (iptables' own counters)."""
        listing = subprocess.run(["iptables", "-L", "INPUT", "-v", "-x", "-n"], check=True,
                                 capture_output=True, text=True).stdout
        return sum(int(line.split()[0]) for line in listing.splitlines()
                   if line.split()[2:3] == ["DROP"])

    def clear(self) -> None:
        for rule in self._rules:
            subprocess.run(["iptables", "-D", *rule], check=False)
        self._rules.clear()
        if self._netem:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
            self._netem = False
