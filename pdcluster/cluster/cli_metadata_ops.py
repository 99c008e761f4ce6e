"""Operating the metadata service: its etcd options (`pdcluster metadata serve --etcd-*`),
`pdcluster metadata etcd-setup` (a user confined to pdcluster's prefix: metadata_service/
etcd_access.py), and the operator's `release-node` and `router-token`. Passwords come from
files only: a flag's value is visible to every process on the host (`ps`).

API: `add_etcd_access_args(parser)`, `etcd_access_fields(args)`, `add_etcd_setup(commands)`,
`add_metadata_operator_commands(commands)`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcluster.cluster.cli_common import (
    UsageError,
    add_command,
    cluster_secret_from_env,
    config_errors_as_usage,
)


def add_etcd_access_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd-tls-ca", default=None,
                        help="PEM CA that signed etcd's server certificate: speak TLS to etcd")
    parser.add_argument("--etcd-tls-cert", default=None,
                        help="PEM client certificate for etcd --client-cert-auth (with "
                        "--etcd-tls-key)")
    parser.add_argument("--etcd-tls-key", default=None, help="PEM key of --etcd-tls-cert")
    parser.add_argument("--etcd-tls-server-name", default=None,
                        help="the name checked in etcd's certificate, if not the endpoint's")
    parser.add_argument("--etcd-user", default=None,
                        help="etcd user (its role: readwrite on the prefix only; see "
                        "`pdcluster metadata etcd-setup`)")
    parser.add_argument("--etcd-password-file", default=None,
                        help="file holding --etcd-user's password")


def etcd_access_fields(args: argparse.Namespace) -> dict[str, Any]:
    """MetadataConfig's etcd_tls/etcd_user/etcd_password from the flags above."""
    from pdcluster.core.tls import ClientTLS

    if args.etcd_tls_ca is None and (args.etcd_tls_cert or args.etcd_tls_key
                                     or args.etcd_tls_server_name):
        raise UsageError("--etcd-tls-cert, --etcd-tls-key and --etcd-tls-server-name need "
                         "--etcd-tls-ca (TLS to etcd)")
    with config_errors_as_usage():
        tls = ClientTLS.from_fields(args.etcd_tls_ca, args.etcd_tls_cert, args.etcd_tls_key,
                                    args.etcd_tls_server_name)
    if (args.etcd_user is None) != (args.etcd_password_file is None):
        raise UsageError("--etcd-user and --etcd-password-file go together")
    password = None if args.etcd_password_file is None else _read_secret(args.etcd_password_file)
    return {"etcd_tls": tls, "etcd_user": args.etcd_user, "etcd_password": password}


def add_etcd_setup(commands: argparse._SubParsersAction) -> None:
    setup = add_command(
        commands, "etcd-setup",
        "As etcd's root: create a role with readwrite on the metadata prefix only, a user "
        "holding only that role, and enable etcd's auth (adding the root user it requires). "
        "Idempotent: rerun it to reset the user's password.",
        _cmd_etcd_setup)
    setup.add_argument("--etcd", default="127.0.0.1:2379",
                       help="comma-separated etcd endpoints host:port")
    setup.add_argument("--etcd-prefix", default="/pdcluster/metadata", help="etcd key prefix")
    setup.add_argument("--root-password-file", required=True,
                       help="file holding etcd's root password (set by this command if etcd "
                       "has no root user yet)")
    add_etcd_access_args(setup)


def _cmd_etcd_setup(args: argparse.Namespace) -> int:
    import etcd3aio
    import grpc

    from pdcluster.core.tls import TLSFileError
    from pdcluster.metadata_service.etcd_access import EtcdAccessError, setup_prefix_role

    fields = etcd_access_fields(args)
    if fields["etcd_user"] is None:
        raise UsageError("etcd-setup needs --etcd-user and --etcd-password-file")
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    try:
        done = asyncio.run(setup_prefix_role(
            endpoints, fields["etcd_tls"], args.etcd_prefix, fields["etcd_user"],
            fields["etcd_password"], _read_secret(args.root_password_file)))
    except (EtcdAccessError, TLSFileError, etcd3aio.EtcdError, grpc.RpcError, TimeoutError,
            OSError) as exc:
        raise UsageError(f"etcd-setup failed: {exc}") from exc
    for line in done:
        print(line)
    return 0


def _read_secret(path: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not value:
        raise UsageError(f"{path} is empty")
    return value


def add_metadata_operator_commands(
    commands: argparse._SubParsersAction,
    add_metadata_tls_args: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`release-node` (with the metadata client's TLS flags, `add_metadata_tls_args`: the
    serve commands' own, passed in because cli_services imports this module) and
    `router-token`."""
    release = add_command(
        commands, "release-node",
        "Operator action: forget a node id's live registration, so that a new key may "
        "register it at once (a restarted node otherwise waits for the old lease to end). "
        "Needs the cluster secret ($PDCLUSTER_CLUSTER_SECRET[_FILE]).",
        _cmd_release_node,
    )
    release.add_argument("node_id", help="the node id to release")
    release.add_argument("--metadata", required=True, help="metadata service host:port")
    add_metadata_tls_args(release)
    add_command(commands, "router-token",
                "Print the router's client credential (principal 'service'), derived from the "
                "cluster secret ($PDCLUSTER_CLUSTER_SECRET[_FILE]): give it to `pdcluster "
                "router serve` as $PDCLUSTER_ROUTER_TOKEN[_FILE] instead of the secret.",
                _cmd_router_token)


def _cmd_release_node(args: argparse.Namespace) -> int:
    from pdcluster.core.credentials import OPERATOR
    from pdcluster.core.tls import ClientTLS
    from pdcluster.metadata_service.client import MetadataClient
    from pdcluster.metadata_service.errors import MetadataError

    secret = cluster_secret_from_env("pdcluster metadata release-node")
    with config_errors_as_usage():
        tls = ClientTLS.from_fields(args.metadata_tls_ca, args.metadata_tls_cert,
                                    args.metadata_tls_key, args.metadata_tls_server_name)
    with MetadataClient(args.metadata, token=secret.metadata_token(OPERATOR), tls=tls) as client:
        try:
            client.release_node(args.node_id)
        except MetadataError as exc:
            raise UsageError(str(exc)) from exc
    print(f"released node id {args.node_id}")
    return 0


def _cmd_router_token(args: argparse.Namespace) -> int:
    from pdcluster.core.credentials import SERVICE

    print(cluster_secret_from_env("pdcluster metadata router-token").metadata_token(SERVICE))
    return 0
