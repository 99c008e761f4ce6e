"""A slow, lossy link and a partition between the nodes, healed after 10 s: `python -m benchmarks
chaos` at a small size moves its whole run (Ray, nodes, metadata service, router, load) into a
network namespace of its own and drops the nodes' KV packets there (iptables; delay too where
the kernel has netem). Goals: no request lost, nothing leaked, the index exact within a lease
TTL afterwards. Needs root, `unshare`, `ip` and `iptables`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from benchmarks.__main__ import main

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("unshare", "iptables"))),
                       reason="needs root, unshare and iptables for a private network "
                       "namespace"),
]


def test_a_lossy_link_and_a_partition_lose_nothing(capsys):
    status = main(["chaos", "--json", "--quick", "--faults", "slow_link,partition",
                   "--soak-s", "0", "--num-prefill", "1", "--num-decode", "1",
                   "--lease-ttl", "3", "--rate", "6", "--requests", "40",
                   "--max-tokens", "8", "--kv-blocks", "256"])
    assert status == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("slow_link", "partition"):
        fault = result["faults"][name]
        assert fault["link_ports"] >= 4, name  # both nodes' side channel and Mooncake ports
        assert fault["failed"] == 0 and fault["truncated"] == 0, (name, fault)
        assert fault["leaked_blocks"] == 0, (name, fault["leaks_per_node"])
        assert fault["index_exact_within_ttl"], (name, fault.get("index_problems"))
        assert result["goals"][name], name
    assert result["faults"]["partition"]["loss"] == 1.0
    for name in ("slow_link", "partition"):  # the faults were real: KV packets were dropped
        assert result["faults"][name]["packets_dropped"] > 0, name
        assert result["faults"][name]["decode_transfers"]["recvs_ok"] > 0, name
