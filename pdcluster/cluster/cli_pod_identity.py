"""`pdcluster metadata serve`'s pod-identity flags: issue node tokens to Kubernetes pods for
their projected service-account tokens (metadata_service/node_tokens.py).

API: `add_pod_identity_args(parser)`, `pod_identity_config(args)`.
"""

from __future__ import annotations

import argparse

from pdcluster.cluster.cli_common import UsageError

# a pod's own service-account token and CA (metadata_service.tokenreview.SERVICE_ACCOUNT_DIR;
# the CLI imports the service's modules only when it runs the service)
_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def add_pod_identity_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "pod identity (Kubernetes)",
        "Issue each node its token for its pod's projected service-account token, checked "
        "with the TokenReview API, so that no Ray pod holds the cluster secret. Only node ids "
        "on --allow-nodes (or, without it, of a role --max-nodes bounds) are issued.")
    group.add_argument("--pod-identity-audience", default=None, metavar="AUDIENCE",
                       help="the audience the pods' projected tokens name (turns this on)")
    group.add_argument("--pod-identity-service-account", default=None,
                       metavar="NAMESPACE:NAME",
                       help="the only service account whose pods get node tokens (the Ray pods')")
    group.add_argument("--pod-identity-token-ttl", type=int, default=600,
                       help="most seconds an issued node token lives (nodes renew it)")
    group.add_argument("--kubernetes-api", default=None, metavar="URL",
                       help="the API server (default: the pod's, from "
                       "$KUBERNETES_SERVICE_HOST/PORT)")
    group.add_argument("--kubernetes-token-file", default=f"{_ACCOUNT_DIR}/token",
                       help="this service's own service-account token (creates TokenReviews)")
    group.add_argument("--kubernetes-ca-file", default=f"{_ACCOUNT_DIR}/ca.crt",
                       help="the CA that signed the API server's certificate")


def pod_identity_config(args: argparse.Namespace):
    """A `PodIdentityConfig` from the flags, or None without --pod-identity-audience."""
    if args.pod_identity_audience is None:
        if args.pod_identity_service_account is not None:
            raise UsageError("--pod-identity-service-account needs --pod-identity-audience")
        return None
    from pdcluster.metadata_service.node_tokens import PodIdentityConfig
    from pdcluster.metadata_service.tokenreview import KubernetesAPI, in_cluster_url

    namespace, sep, name = (args.pod_identity_service_account or "").partition(":")
    if not sep or not namespace or not name:
        raise UsageError("--pod-identity-audience needs --pod-identity-service-account "
                         "NAMESPACE:NAME (the Ray pods' service account)")
    try:
        url = args.kubernetes_api or in_cluster_url()
        api = KubernetesAPI(url=url, token_file=args.kubernetes_token_file,
                            ca_file=args.kubernetes_ca_file or None)
        return PodIdentityConfig(audience=args.pod_identity_audience, namespace=namespace,
                                 service_account=name, api=api,
                                 token_ttl_s=args.pod_identity_token_ttl)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
