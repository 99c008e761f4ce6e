"""The chart's side of the authenticated internal plane: the cluster secret reaches the pods
that need it (the metadata service, and the Ray head where the launcher derives each node
actor's own token; never a Ray worker) as a read-only file named by
$PDCLUSTER_CLUSTER_SECRET_FILE,
the old shared metadata token is gone, every pdcluster listener binds its pod's IP, and the
NetworkPolicies admit exactly the traffic the components need. The policies are checked by
evaluating them (Kubernetes' semantics for pod, namespace and port matching) on the pods the
chart really renders, not by reading their text."""

from __future__ import annotations

import base64
import re

import pytest

from tests.k8s.chart import (
    CHART,
    CLUSTER_SECRET,
    NAMESPACE,
    RELEASE,
    REPO_ROOT,
    VALUE_SETS,
    chart_defaults,
    containers,
    env_of,
    find,
    merged,
    needs_helm,
    one,
    pod_templates,
    render,
    template,
)

pytestmark = needs_helm

SETS = sorted(VALUE_SETS)
SECRET_DIR = "/var/run/secrets/pdcluster"
SECRET_FILE = f"{SECRET_DIR}/cluster-secret"
# Pods that run pdcluster code: the cluster secret in the metadata service and on the Ray head
# (the launcher's driver); the router holds its client credential only, the metadata service
# both (it accepts the router's); a Ray worker none: its node actors get their own tokens from
# the launcher.
CONSUMERS = {"router", "metadata", "ray-head", "ray-prefill", "ray-decode"}
ROUTER_TOKEN_DIR = "/var/run/secrets/pdcluster-router"
CREDENTIALS = {"router": ["router-token"], "metadata": ["cluster-secret", "router-token"],
               "ray-prefill": [], "ray-decode": []}


def values_of(name: str) -> dict:
    return merged(chart_defaults(), VALUE_SETS[name])


def component_pods(docs: list[dict]) -> dict[str, dict]:
    """component label -> pod template, for every pod the chart's objects create."""
    pods = {}
    for doc in docs:
        for _, tmpl in pod_templates(doc):
            pods[tmpl["metadata"]["labels"]["app.kubernetes.io/component"]] = tmpl
    return pods


# --- the cluster secret ---------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_cluster_secret_is_mounted_into_every_consumer(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    secret_name = values["secrets"]["existingSecret"] or f"{RELEASE}-pdcluster-secrets"
    pods = component_pods(docs)
    assert set(pods) >= CONSUMERS, sorted(pods)
    for component, tmpl in pods.items():
        spec = tmpl["spec"]
        # the credentials' Secret (TLS certificates: test_metadata_tls.py, test_etcd_access.py)
        volumes = [v for v in spec.get("volumes", [])
                   if v.get("secret", {}).get("secretName") == secret_name]
        if component not in CONSUMERS:
            # etcd, the launcher Job and the etcd-setup Job hold no cluster credential
            assert not volumes, component
            continue
        keys = CREDENTIALS.get(component, ["cluster-secret"])
        if component == "ray-head" and values["metadata"]["podIdentity"]["enabled"]:
            keys = []  # its launcher derives no token: the nodes trade their pods' own
        assert [v["secret"]["items"][0]["key"] for v in volumes] == keys, component
        (container,) = spec["containers"]
        env = env_of(container)
        for volume in volumes:
            key = volume["secret"]["items"][0]["key"]
            assert volume["secret"] == {"secretName": secret_name, "defaultMode": 0o400,
                                        "items": [{"key": key, "path": key}]}, component
            mounts = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
            directory = SECRET_DIR if key == "cluster-secret" else ROUTER_TOKEN_DIR
            assert mounts == [{"name": volume["name"], "mountPath": directory,
                               "readOnly": True}]
        assert ("PDCLUSTER_CLUSTER_SECRET_FILE" in env) == ("cluster-secret" in keys)
        if "cluster-secret" in keys:
            assert env["PDCLUSTER_CLUSTER_SECRET_FILE"] == {
                "name": "PDCLUSTER_CLUSTER_SECRET_FILE", "value": SECRET_FILE}
        if "router-token" in keys:
            assert env["PDCLUSTER_ROUTER_TOKEN_FILE"]["value"] == \
                f"{ROUTER_TOKEN_DIR}/router-token"
        assert "PDCLUSTER_CLUSTER_SECRET" not in env  # never in the env
        user = container.get("securityContext", {}).get("runAsUser", 0)
        if user:
            # a Secret's files are root's: the pod's fsGroup is what lets the service read it
            assert spec["securityContext"]["fsGroup"] == user, component
        for init in spec.get("initContainers", []):
            assert not any(m["name"] == v["name"] for v in volumes
                           for m in init.get("volumeMounts", []))


def test_long_cluster_secret_is_accepted() -> None:
    secret = one(render({"secrets": {"clusterSecret": "AB" * 64}}), "Secret", CLUSTER_SECRET)
    assert base64.b64decode(secret["data"]["cluster-secret"]).decode() == "AB" * 64


@pytest.mark.parametrize("name", SETS)
def test_no_metadata_token_anywhere(name: str) -> None:
    """The shared static token is replaced by the cluster secret's derived credentials."""
    out = template(VALUE_SETS[name]).stdout
    assert "metadata-token" not in out and "METADATA_TOKEN" not in out


def test_no_metadata_token_in_the_chart_or_its_docs() -> None:
    files = [*CHART.rglob("*.yaml"), *CHART.rglob("*.tpl"), *CHART.rglob("*.json"),
             CHART / "templates" / "NOTES.txt", CHART / "README.md",
             REPO_ROOT / "docs" / "deploy.md"]
    for path in files:
        text = path.read_text()
        for word in ("metadata-token", "METADATA_TOKEN", "metadataToken"):
            assert word not in text, f"{path.relative_to(REPO_ROOT)} mentions {word}"


def test_deploy_docs_tell_how_to_create_and_rotate_the_secret() -> None:
    docs = (REPO_ROOT / "docs" / "deploy.md").read_text()
    assert "cluster-secret" in docs and "openssl rand -hex 32" in docs
    assert re.search(r"rolling restart|rollout restart", docs)


# --- listeners ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_listeners_bind_the_pod_ip(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    for where, c in containers(docs):
        env = env_of(c)
        args = c.get("args", [])
        if c["name"] in ("router", "metadata"):
            (host,) = [a.split("=", 1)[1] for a in args if a.startswith("--host=")]
            wanted = (values["router"]["host"] if c["name"] == "router" else "") or "$(POD_IP)"
            assert host == wanted, where
        if c["name"] in ("router", "metadata", "etcd", "ray-head", "ray-worker"):
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
        if c["name"] == "etcd":
            for flag in ("--listen-client-urls", "--listen-peer-urls", "--listen-metrics-urls"):
                (urls,) = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
                hosts = {u.split("//")[1].rsplit(":", 1)[0] for u in urls.split(",")}
                assert hosts <= {"$(POD_IP)", "127.0.0.1"}, (flag, urls)
        # no wildcard anywhere but where the values ask for one
        if values["router"]["host"] != "0.0.0.0":
            assert not any("0.0.0.0" in a for a in args), (where, args)


def test_router_host_override() -> None:
    deploy = one(render({"router": {"host": "0.0.0.0"}}), "Deployment",
                 f"{RELEASE}-pdcluster-router")
    assert "--host=0.0.0.0" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


# --- NetworkPolicies ------------------------------------------------------------------------


def label_selects(selector: dict, labels: dict) -> bool:
    """Kubernetes' LabelSelector semantics (an empty selector selects everything)."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, vals = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and key in labels and labels[key] in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}


def peer_admits(peer: dict, namespace: str, labels: dict) -> bool:
    if "ipBlock" in peer:
        return False  # pods are matched by selectors here; ipBlocks are checked on their own
    if "namespaceSelector" in peer:
        if not label_selects(peer["namespaceSelector"], namespace_labels(namespace)):
            return False
    elif namespace != NAMESPACE:
        return False  # a podSelector alone means the policy's own namespace
    return label_selects(peer.get("podSelector", {}), labels)


def allowed(docs: list[dict], dst: dict, port: int, namespace: str, src: dict) -> bool:
    """May a pod labelled `src` in `namespace` open TCP `port` on a pod labelled `dst` in the
    release's namespace? Not isolated: yes. Isolated: if any rule of any selecting policy
    admits both the peer and the port."""
    policies = [p for p in find(docs, "NetworkPolicy")
                if "Ingress" in p["spec"]["policyTypes"]
                and label_selects(p["spec"]["podSelector"], dst)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None:
                assert all(isinstance(p["port"], int) for p in ports), ports
                if not any(p["port"] <= port <= p.get("endPort", p["port"])
                           and p.get("protocol", "TCP") == "TCP" for p in ports):
                    continue
            peers = rule.get("from")
            if peers is None or any(peer_admits(p, namespace, src) for p in peers):
                return True
    return False


def labels_of(docs: list[dict]) -> dict[str, dict]:
    return {c: t["metadata"]["labels"] for c, t in component_pods(docs).items()}


SUBMITTER = "submitter"  # the RayJob's submitter pod (KubeRay's Job; not in the chart)
STRANGER = {"app": "something-else"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}


def pods_and_peers(docs: list[dict]) -> dict[str, dict]:
    pods = labels_of(docs)
    launch = [d for d in docs if d["kind"] == "RayJob"
              and d["spec"]["submissionMode"] == "K8sJobMode"]
    if launch:
        # Kubernetes' Job controller labels the submitter pod with its Job's name, which
        # KubeRay makes the RayJob's name.
        pods[SUBMITTER] = {"job-name": launch[0]["metadata"]["name"],
                           "batch.kubernetes.io/job-name": launch[0]["metadata"]["name"]}
    return pods


def ports_of(tmpl: dict) -> set[int]:
    return {p["containerPort"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}


@pytest.mark.parametrize("name", SETS)
def test_network_policies(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    policies = find(docs, "NetworkPolicy")
    if not values["networkPolicy"]["enabled"]:
        assert not policies
        return
    pods = pods_and_peers(docs)
    tmpls = component_pods(docs)
    # Every pod of the release is isolated, and every policy protects some real pod.
    for component, labels in labels_of(docs).items():
        assert any(label_selects(p["spec"]["podSelector"], labels) for p in policies), component
    for policy in policies:
        assert any(label_selects(policy["spec"]["podSelector"], labels)
                   for labels in labels_of(docs).values()), policy["metadata"]["name"]
        # every port a policy names is a port its pods listen on
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert any(port["port"] in ports_of(t) for t in tmpls.values()
                           if label_selects(policy["spec"]["podSelector"],
                                            t["metadata"]["labels"])), (policy, port)

    router_port = values["router"]["port"]
    metadata_port = values["metadata"]["port"]

    def ok(src: str | dict, dst: str, port: int, namespace: str = NAMESPACE) -> bool:
        src_labels = pods[src] if isinstance(src, str) else src
        return allowed(docs, pods[dst], port, namespace, src_labels)

    nodes = ("ray-prefill", "ray-decode")
    ray = ("ray-head", *nodes)
    # the router: the public endpoint (unless restricted); it reaches the node actors' request
    # ports (one per node actor of a pod) and nothing else of theirs: not the KV side channel,
    # not Mooncake's unauthenticated transfer port
    restricted = bool(values["networkPolicy"]["routerIngressFrom"])
    assert ok(STRANGER, "router", router_port) != restricted
    assert ok(STRANGER, "router", router_port, "elsewhere") != restricted
    if restricted:
        assert ok({}, "router", router_port, "ingress-nginx")
    first = values["cluster"]["node"]["requestPort"]
    per_pod = max(-(-values["ray"][role]["gpusPerPod"] // values["cluster"]["node"]["gpus"])
                  for role in ("prefill", "decode"))
    request_ports = range(first, first + per_pod)
    for node in nodes:
        for port in request_ports:
            assert ok("router", node, port), (node, port)
        for port in (first - 1, first + per_pod, 17000, 34567, 5555):
            assert not ok("router", node, port), (node, port)
        for port in (*request_ports, 17000, 34567):  # request, side channel, Mooncake
            assert not ok(STRANGER, node, port)
            assert not ok("metadata", node, port)
            assert not ok(STRANGER, node, port, "elsewhere")
            for peer in ray:
                assert ok(peer, node, port), (peer, node)
    assert not ok("router", "ray-head", 6379) and not ok("router", "ray-head", 8265)
    # Ray's own traffic among all Ray pods, on any port (GCS 6379, raylets, agents, workers)
    for src in ray:
        for dst in ray:
            for port in (6379, 8265, 10001, 52365, 10002, 19999):
                assert ok(src, dst, port), (src, dst, port)
    # the metadata service: cluster components only
    for src in ("router", *ray):
        assert ok(src, "metadata", metadata_port), src
    for src in (STRANGER, *(["etcd"] if "etcd" in pods else [])):
        assert not ok(src, "metadata", metadata_port), src
    assert not ok(STRANGER, "metadata", metadata_port, "elsewhere")
    # etcd: the metadata service (client) and its members (peer) only
    if "etcd" in pods:
        assert ok("metadata", "etcd", 2379) and ok("etcd", "etcd", 2380)
        for src in ("router", *ray, STRANGER):
            assert not ok(src, "etcd", 2379) and not ok(src, "etcd", 2380), src
    # the Ray head's job API: the launcher (Job or RayJob submitter) and the KubeRay operator
    launcher = "launcher" if values["launcher"]["mode"] == "job" else SUBMITTER
    if launcher in pods:
        assert ok(launcher, "ray-head", 8265)
        assert not ok(launcher, "ray-head", 6379)
        assert not ok(launcher, "metadata", metadata_port)
        assert not ok(launcher, "ray-prefill", 5555)
    operator_ns = "kuberay-system"
    assert ok(OPERATOR, "ray-head", 8265, operator_ns)
    assert not ok(STRANGER, "ray-head", 8265) and not ok(OPERATOR, "ray-prefill", 8265,
                                                          operator_ns)
    if "launcher" in pods:
        assert not ok(STRANGER, "launcher", 8080) and not ok("ray-head", "launcher", 8080)
    # metrics: Prometheus (in its namespace) scrapes the router's admin port and the Ray
    # pods' metrics port; nobody else reaches the router's admin port
    metrics_ns = "monitoring"
    prom = PROMETHEUS
    admin_port = values["router"]["adminPort"]
    assert ok(prom, "router", admin_port, metrics_ns)
    assert not ok(STRANGER, "router", admin_port)
    assert not ok(prom, "router", admin_port, "elsewhere")  # the label alone is not enough
    for dst in ray:
        assert ok(prom, dst, 8080, metrics_ns), dst
        assert not ok(prom, dst, 6379, metrics_ns), dst
    assert not ok(prom, "metadata", metadata_port, metrics_ns)


def test_network_policies_admit_host_network_workers_by_node_cidr() -> None:
    docs = render(VALUE_SETS["rdma-host-network"])
    cidrs = VALUE_SETS["rdma-host-network"]["networkPolicy"]["nodeCIDRs"]
    for policy_name in ("metadata", "ray"):
        policy = one(docs, "NetworkPolicy", f"{RELEASE}-pdcluster-{policy_name}")
        blocks = [p["ipBlock"]["cidr"] for rule in policy["spec"]["ingress"]
                  for p in rule.get("from", []) if "ipBlock" in p]
        assert blocks == cidrs, policy_name
    for policy in find(render({}), "NetworkPolicy"):
        assert "ipBlock" not in str(policy), policy["metadata"]["name"]


def test_network_policies_render_the_given_peers() -> None:
    values = VALUE_SETS["network-policy-restricted"]["networkPolicy"]
    docs = render(VALUE_SETS["network-policy-restricted"])
    router = one(docs, "NetworkPolicy", f"{RELEASE}-pdcluster-router")
    assert [r["from"] for r in router["spec"]["ingress"]] == [values["routerIngressFrom"],
                                                               values["metricsFrom"]]
    head = one(docs, "NetworkPolicy", f"{RELEASE}-pdcluster-ray-head")
    (rule,) = head["spec"]["ingress"]
    assert rule["from"][1:] == values["rayDashboardFrom"]
    assert {"ipBlock": {"cidr": "192.168.0.0/24"}} in rule["from"]


# --- what the chart refuses without an acknowledgement -------------------------------------


@pytest.mark.parametrize("values, match", [
    ({"ray": {"auth": {"enabled": False}}}, "ray.auth.enabled is false"),
    ({"router": {"apiKeys": []}}, "router.apiKeys is empty"),
    ({"rdma": {"enabled": True, "hostNetwork": True},
      "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16"]}}, "rdma.hostNetwork puts the Ray"),
    ({"networkPolicy": {"metricsFrom": [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]}},
     "networkPolicy.metricsFrom: a namespaceSelector must name"),
    ({"networkPolicy": {"rayDashboardFrom": [{"namespaceSelector": {"matchLabels": {
        "team": "ops"}}}]}}, "networkPolicy.rayDashboardFrom: a namespaceSelector"),
    ({"networkPolicy": {"routerIngressFrom": [{"namespaceSelector": {}}]}},
     "networkPolicy.routerIngressFrom"),
], ids=["ray-auth-off", "open-api", "host-network", "any-namespace-metrics",
        "other-label-dashboard", "any-namespace-ingress"])
def test_the_chart_refuses_an_unfenced_setting_unless_acknowledged(values, match) -> None:
    refused = template(values, check=False)
    assert refused.returncode != 0 and match in refused.stderr, refused.stderr[-500:]


@pytest.mark.parametrize("values", [
    {"ray": {"auth": {"enabled": False, "acknowledgeDisabled": True}}},
    {"router": {"apiKeys": [], "acknowledgeOpenApi": True}},
    {"secrets": {"existingSecret": "pd-secrets"}},  # the keys are that Secret's business
    {"rdma": {"enabled": True, "hostNetwork": True, "acknowledgeUnfencedHostNetwork": True},
     "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16"]}},
    {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In",
         "values": ["monitoring"]}]}}]}},
], ids=["ray-auth-off-acknowledged", "open-api-acknowledged", "existing-secret",
        "host-network-acknowledged", "namespace-by-expression"])
def test_the_acknowledged_or_fenced_setting_renders(values) -> None:
    assert template(values).returncode == 0


# --- Ray pods: fenced root by default, a non-root uid where the image allows

def _ray_pods(values: dict) -> list[tuple[dict, dict]]:
    """(pod spec, its Ray container) of the head and each worker group."""
    (cluster,) = [d for d in render(values) if d["kind"] == "RayCluster"]
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    return [(g["template"]["spec"], g["template"]["spec"]["containers"][0]) for g in groups]


@pytest.mark.parametrize("run_as", [None, 1000])
def test_the_launcher_job_runs_as_the_ray_head_does(run_as) -> None:
    docs = render({"launcher": {"mode": "job"}, "ray": {"runAsUser": run_as}})
    (job,) = [d for d in docs if d["kind"] == "Job"
              and d["metadata"]["labels"]["app.kubernetes.io/component"] == "launcher"]
    spec = job["spec"]["template"]["spec"]
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx.get("runAsUser") == run_as and ctx.get("runAsNonRoot") == (run_as and True)
    assert spec.get("securityContext", {}).get("fsGroup") == run_as


@pytest.mark.parametrize("rdma", [False, True])
def test_ray_containers_drop_capabilities_and_escalation(rdma: bool) -> None:
    pods = _ray_pods({"rdma": {"enabled": rdma}})
    assert len(pods) == 3
    for i, (spec, container) in enumerate(pods):
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"]
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        # RDMA's capabilities come back on the workers alone, never on the head
        wanted = ["IPC_LOCK", "NET_RAW"] if rdma and i > 0 else None
        assert ctx["capabilities"].get("add") == wanted
        assert "runAsUser" not in ctx and "securityContext" not in spec  # the image's root


def test_ray_pods_run_as_a_non_root_uid_when_asked() -> None:
    for spec, container in _ray_pods({"ray": {"runAsUser": 1000}}):
        ctx = container["securityContext"]
        assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["runAsGroup"]) == (True, 1000, 1000)
        assert ctx["capabilities"]["drop"] == ["ALL"]
        assert spec["securityContext"]["fsGroup"] == 1000  # the head reads the secret
    custom = {"seccompProfile": {"type": "Localhost", "localhostProfile": "ray.json"}}
    for _, container in _ray_pods({"ray": {"securityContext": custom}}):
        assert container["securityContext"]["seccompProfile"] == custom["seccompProfile"]
    refused = template({"ray": {"runAsUser": 1000}, "rdma": {"enabled": True}}, check=False)
    assert refused.returncode != 0 and "CAP_IPC_LOCK" in refused.stderr, refused.stderr[-500:]


# --- model downloads: a commit, not a name that moves

_HUB = {"source": "hub", "name": "m", "hub": {"repo": "org/m"}}
_COMMIT = "7ae557604adf67be50417f59c2c2f167def9a775"


def _download_env(values: dict) -> dict[str, str]:
    inits = [c for _, c in containers(render(values), init=True)]
    assert inits
    envs = [{e["name"]: e.get("value") for e in c["env"] if "value" in e} for c in inits]
    names = ("PDCLUSTER_MODEL_REVISION", "PDCLUSTER_MODEL_ALLOW_UNPINNED")
    assert len({tuple(env.get(n) for n in names) for env in envs}) == 1  # every pod alike
    return envs[0]


@pytest.mark.parametrize("revision", ["", "main", "v1.0", _COMMIT[:7]])
def test_the_chart_refuses_a_model_revision_that_is_not_a_commit(revision: str) -> None:
    values = {"model": {**_HUB, "hub": {**_HUB["hub"], "revision": revision}}}
    refused = template(values, check=False)
    assert refused.returncode != 0, "an unpinned hub download rendered"
    assert "model.hub.revision" in refused.stderr and "is not a commit" in refused.stderr


def test_a_pinned_or_acknowledged_model_revision_renders() -> None:
    env = _download_env({"model": {**_HUB, "hub": {**_HUB["hub"], "revision": _COMMIT}}})
    assert env["PDCLUSTER_MODEL_REVISION"] == _COMMIT
    assert "PDCLUSTER_MODEL_ALLOW_UNPINNED" not in env
    env = _download_env({"model": {**_HUB, "hub": {
        **_HUB["hub"], "revision": "main", "acknowledgeUnpinnedRevision": True}}})
    assert env["PDCLUSTER_MODEL_REVISION"] == "main"
    assert env["PDCLUSTER_MODEL_ALLOW_UNPINNED"] == "1"
    assert template({"model": {"source": "pvc"}}).returncode == 0  # no download, no revision


# --- metadata gRPC: plaintext or unbound client certificates need an acknowledgement

_SECRETS = {"secretName": "md-tls", "clientAuth": {"routerSecretName": "md-router",
                                                  "nodeSecretName": "md-node"}}
_TLS = {"enabled": True, "secretName": "md-tls"}
_BOUND = {**_TLS, "clientAuth": {"enabled": True, **_SECRETS["clientAuth"]}}


@pytest.mark.parametrize("metadata, match", [
    ({"acknowledgePlaintext": False, "tls": {"enabled": False}},
     "metadata.tls.enabled is false"),
    ({"acknowledgeUnboundClients": False, "tls": {**_TLS, "clientAuth": {"enabled": False}}},
     "without clientAuth.enabled"),
    ({"acknowledgeUnboundClients": False,
      "tls": {**_BOUND, "clientAuth": {**_BOUND["clientAuth"], "bindRoles": False}}},
     "without clientAuth.enabled and clientAuth.bindRoles"),
], ids=["plaintext", "tls-without-client-certificates", "mtls-unbound"])
def test_the_chart_refuses_plaintext_or_unbound_metadata_grpc(metadata, match) -> None:
    refused = template({"metadata": metadata}, check=False)
    assert refused.returncode != 0 and match in refused.stderr, refused.stderr[-500:]


@pytest.mark.parametrize("metadata", [
    {"acknowledgePlaintext": True, "tls": {"enabled": False}},
    {"acknowledgeUnboundClients": True, "tls": {**_TLS, "clientAuth": {"enabled": False}}},
    {"acknowledgePlaintext": False, "acknowledgeUnboundClients": False, "tls": _BOUND},
], ids=["plaintext-acknowledged", "unbound-acknowledged", "mtls-bound"])
def test_acknowledged_or_bound_metadata_grpc_renders(metadata) -> None:
    assert template({"metadata": metadata}).returncode == 0


def test_the_metadata_service_admits_only_the_launchers_node_ids() -> None:
    """The launcher starts p0.. and d0..; the service refuses any other id (a token minted
    for p9 by whoever holds the head's secret registers nothing)."""
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.cli_services import node_allowlist

    docs = render({"ray": {"prefill": {"replicas": 3}, "decode": {"replicas": 2}}})
    (container,) = [c for _, c in containers(docs) if c["name"] == "metadata"]
    args = build_parser().parse_args(container["args"][1:])
    assert node_allowlist(args.allow_nodes) == {"prefill": {"p0", "p1", "p2"},
                                                "decode": {"d0", "d1"}}


def test_with_a_planner_the_metadata_service_bounds_the_number_of_nodes() -> None:
    """The planner names each node it starts anew (p0, p1, ... never reused): no fixed list,
    but at most its bound of live nodes per role."""
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.cli_services import max_nodes, node_allowlist

    docs = render({"planner": {"enabled": True},
                   "router": {"replicas": 1, "hpa": {"enabled": False}},
                   "ray": {"prefill": {"maxReplicas": 4}, "decode": {"gpusPerPod": 2,
                                                                       "maxReplicas": 3}}})
    (container,) = [c for _, c in containers(docs) if c["name"] == "metadata"]
    args = build_parser().parse_args(container["args"][1:])
    assert node_allowlist(args.allow_nodes) is None
    assert max_nodes(args.max_nodes) == {"prefill": 4, "decode": 6}
