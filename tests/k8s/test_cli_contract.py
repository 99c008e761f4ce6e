"""The commands the chart runs exist with the flags it passes: the metadata service's and the
router's arguments parse with the real `pdcluster` parser, and the launcher module takes
--config. A part that is missing fails the test."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.cluster import cli
from tests.k8s.chart import (
    CLUSTER_SECRET,
    RELEASE,
    REPO_ROOT,
    VALUE_SETS,
    cluster_config,
    needs_helm,
    one,
    render,
)

pytestmark = needs_helm


POD_IP = "10.1.2.3"


def command_of(values: dict, component: str) -> list[str]:
    """The container's arguments as the kubelet passes them: $(VAR) of the container's env
    substituted, with the downward API's status.podIP as POD_IP."""
    deploy = one(render(values), "Deployment", f"{RELEASE}-pdcluster-{component}")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pdcluster"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    values_of = {name: e.get("value", POD_IP if name == "POD_IP" else None)
                 for name, e in env.items()}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values_of[m.group(1)], a)
            for a in container["args"]]
    assert not any("$(" in a for a in args), args
    return args


def subcommands(parser) -> dict:
    (action,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return action.choices


@pytest.mark.parametrize("name", ["default", "external-etcd", "memory-metadata"])
def test_metadata_service_arguments_parse_and_validate(name: str, tmp_path) -> None:
    from pdcluster.metadata_service.config import MetadataConfig

    args = cli.build_parser().parse_args(command_of(VALUE_SETS[name], "metadata"))
    assert (args.command, args.metadata_command) == ("metadata", "serve")
    assert args.host == POD_IP  # the pod's IP, never a wildcard
    # What `pdcluster metadata serve` builds from them (and the chart's generated cluster
    # secret) must be a valid configuration.
    MetadataConfig(host=args.host, port=args.port, backend=args.backend,
                   etcd_endpoints=tuple(e for e in args.etcd.split(",") if e),
                   etcd_prefix=args.etcd_prefix, hash_size=args.hash_size,
                   default_lease_ttl_s=args.lease_ttl,
                   cluster_secret=chart_cluster_secret(VALUE_SETS[name], tmp_path))


def chart_cluster_secret(values: dict, folder: Path):
    """The generated cluster secret as a pod reads it: the Secret's key written to a file and
    read through $PDCLUSTER_CLUSTER_SECRET_FILE (core.credentials)."""
    from pdcluster.core.credentials import SECRET_FILE_ENV, ClusterSecret

    secret = one(render(values), "Secret", CLUSTER_SECRET)
    path = folder / "cluster-secret"
    path.write_bytes(base64.b64decode(secret["data"]["cluster-secret"]))
    return ClusterSecret.from_env({SECRET_FILE_ENV: str(path)})


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_cluster_yaml_is_accepted_by_the_launcher(name: str) -> None:
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.engine.config import EngineConfig

    config = cluster_config(render(VALUE_SETS[name]))
    parsed = ClusterConfig.from_dict(config)
    assert (parsed.num_prefill, parsed.num_decode) == (config["num_prefill"],
                                                       config["num_decode"])
    assert parsed.metadata_address == config["metadata"]["address"]
    assert parsed.kv_protocol == config["transfer"]["protocol"]
    assert parsed.node_gpus == config["node"]["gpus"]
    assert set(config["engine"]) <= set(EngineConfig.__dataclass_fields__)


def test_router_arguments_parse() -> None:
    parser = cli.build_parser()
    assert "router" in subcommands(parser)
    args = parser.parse_args(command_of(VALUE_SETS["ingress"], "router"))
    assert args.command == "router"
    assert args.host == POD_IP
    assert args.also_listen == ["127.0.0.1"]  # the pod's loopback: `kubectl port-forward`
    args = parser.parse_args(command_of(VALUE_SETS["network-policy-off"], "router"))
    assert args.host == "0.0.0.0"  # router.host overrides
    assert args.also_listen == []  # a wildcard covers the loopback
    args = parser.parse_args(command_of({"router": {"listenOnLoopback": False}}, "router"))
    assert (args.host, args.also_listen) == (POD_IP, [])


def test_launcher_module_takes_config() -> None:
    """The chart runs `python -m pdcluster.cluster.launch --config /etc/pdcluster/cluster.yaml`."""
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cluster.launch", "--help"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout
