"""The rendered objects fit together: what one names, another provides (Secrets, ConfigMaps,
Services' and PDBs' selectors, the HPA's and Ingress's targets, monitors' ports), names fit
Kubernetes' limits, secrets and etcd are set up as asked, NOTES.txt tells how to call the
endpoint, and the Grafana dashboard queries the metrics docs/deploy.md lists."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.k8s.chart import (
    CHART,
    CLUSTER_SECRET,
    RELEASE,
    REPO_ROOT,
    VALUE_SETS,
    chart_defaults,
    cluster_config,
    containers,
    env_of,
    find,
    helm,
    merged,
    needs_helm,
    one,
    pod_specs,
    pod_templates,
    render,
    with_api_keys,
    with_metadata_transport_acknowledged,
    write_values,
)

pytestmark = needs_helm

SETS = sorted(VALUE_SETS)
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
EXTERNAL_SECRETS = {"pd-secrets", "hf-token", "llm-tls", "registry-creds"}


def values_of(name: str) -> dict:
    return merged(chart_defaults(), VALUE_SETS[name])


def pod_labels(docs: list[dict]) -> list[dict]:
    return [tmpl["metadata"].get("labels", {}) for doc in docs for _, tmpl in pod_templates(doc)]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("name", SETS)
def test_referenced_secrets_and_config_maps_exist(name: str) -> None:
    docs = render(VALUE_SETS[name])
    secrets = {d["metadata"]["name"]: d for d in find(docs, "Secret")} | {
        s: {"data": None} for s in EXTERNAL_SECRETS}
    config_maps = {d["metadata"]["name"]: d for d in find(docs, "ConfigMap")}
    for where, c in [*containers(docs), *containers(docs, init=True)]:
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if not ref:
                continue
            assert ref["name"] in secrets, f"{where}: Secret {ref['name']} not rendered"
            data = secrets[ref["name"]]["data"]
            if data is not None and not ref.get("optional"):
                assert ref["key"] in data, f"{where}: Secret {ref['name']} lacks {ref['key']}"
    for doc in docs:
        for where, tmpl in pod_templates(doc):
            for volume in tmpl["spec"].get("volumes", []):
                if "configMap" in volume:
                    cm = config_maps.get(volume["configMap"]["name"])
                    assert cm is not None, f"{where}: ConfigMap {volume['configMap']['name']}"
            mounted = {v["name"] for v in tmpl["spec"].get("volumes", [])} | {
                claim["metadata"]["name"]
                for claim in doc["spec"].get("volumeClaimTemplates", [])}
            for c in [*tmpl["spec"]["containers"], *tmpl["spec"].get("initContainers", [])]:
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in mounted, f"{where}/{c['name']}: {mount['name']}"
    for command_file in ("download_model.py", "launch_nodes.py"):
        text = one(docs, "ConfigMap", f"{RELEASE}-pdcluster-config")["data"][command_file]
        assert text == (CHART / "files" / command_file).read_text()


@pytest.mark.parametrize("name", SETS)
def test_services_pdbs_hpa_and_ingress_find_their_targets(name: str) -> None:
    docs = render(VALUE_SETS[name])
    labels = pod_labels(docs)
    for kind in ("Service", "PodDisruptionBudget"):
        for doc in find(docs, kind):
            selector = doc["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [lab for lab in labels if selects(selector, lab)]
            assert matched, f"{kind}/{doc['metadata']['name']} selects no pod"
    for doc in find(docs, "Service"):
        ports = {p["name"] for doc2 in docs for _, t in pod_templates(doc2)
                 for c in t["spec"]["containers"] for p in c.get("ports", [])
                 if selects(doc["spec"]["selector"], t["metadata"].get("labels", {}))}
        for port in doc["spec"]["ports"]:
            target = port.get("targetPort", port["name"])
            assert isinstance(target, int) or target in ports, (doc["metadata"]["name"], target)
    deployments = {d["metadata"]["name"] for d in find(docs, "Deployment")}
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        router = one(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in router["spec"]  # the HPA owns it
        (container,) = router["spec"]["template"]["spec"]["containers"]
        assert "cpu" in container["resources"]["requests"]  # utilization needs a request
    services = {d["metadata"]["name"]: d for d in find(docs, "Service")}
    for ingress in find(docs, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                ports = {p["name"] for p in services[backend["name"]]["spec"]["ports"]}
                assert backend["port"]["name"] in ports


@pytest.mark.parametrize("name", SETS)
def test_pdbs_cover_every_component(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    pdbs = find(docs, "PodDisruptionBudget")
    for labels in pod_labels(docs):
        if labels.get("app.kubernetes.io/component") in ("launcher", "etcd-setup"):
            continue  # a run-to-completion Job
        assert any(selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs), labels
    assert {p["spec"]["maxUnavailable"] for p in pdbs} == {values["pdb"]["maxUnavailable"]}


def test_pdbs_can_be_disabled() -> None:
    assert not find(render({"pdb": {"enabled": False}}), "PodDisruptionBudget")


@pytest.mark.parametrize("release", ["pd", "a-rather-long-release-name-for-a-production-cluster"])
def test_names_fit_kubernetes_limits(release: str) -> None:
    out = helm("template", release, str(CHART), "--set", "launcher.mode=job",
               "--set", "router.acknowledgeOpenApi=true").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and DNS_1123_LABEL.match(name), name
    cluster = one(docs, "RayCluster")["metadata"]["name"]
    # KubeRay's own names: <cluster>-head-svc and <cluster>-<group>-worker-<5 chars>.
    assert len(f"{cluster}-prefill-worker-abcde") <= 63
    for label in (f"{cluster}-head-svc", f"{cluster}-decode-worker-abcde"):
        assert DNS_1123_LABEL.match(label)


def test_secret_holds_given_secrets_and_api_keys() -> None:
    import base64

    values = {"secrets": {"clusterSecret": "ab" * 32, "rayAuthToken": "r" * 32,
                          "routerToken": "t" * 40},
              "router": {"apiKeys": ["sk-aaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbb"]}}
    secret = one(render(values), "Secret", CLUSTER_SECRET)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"cluster-secret": "ab" * 32, "auth_token": "r" * 32,
                    "router-token": "t" * 40,
                    "api-keys": "sk-aaaaaaaaaaaaaaaa,sk-bbbbbbbbbbbbbbbb"}
    # an uninstall or a GitOps prune keeps the credentials every pod holds
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_generated_secrets_and_no_api_keys_by_default() -> None:
    import base64

    secret = one(render({"router": {"acknowledgeOpenApi": True}}), "Secret", CLUSTER_SECRET)
    assert set(secret["data"]) == {"cluster-secret", "router-token", "auth_token"}
    cluster_secret = base64.b64decode(secret["data"]["cluster-secret"]).decode()
    # 32 bytes as hex: what core.credentials.ClusterSecret.from_text reads
    assert re.fullmatch(r"[0-9a-f]{64}", cluster_secret), cluster_secret
    # generated afresh by each render (an install); an upgrade reads the live one back
    again = one(render({"router": {"port": 8001, "acknowledgeOpenApi": True}}), "Secret",
                CLUSTER_SECRET)
    assert again["data"]["cluster-secret"] != secret["data"]["cluster-secret"]


def test_existing_secret_is_used_everywhere() -> None:
    docs = render(VALUE_SETS["existing-secret-no-ray-auth"])
    generated = {d["metadata"]["name"] for d in find(docs, "Secret")}
    assert CLUSTER_SECRET not in generated  # only the TLS and etcd credentials are made
    assert all(name.startswith(f"{RELEASE}-pdcluster-") for name in generated)
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for _, c in containers(docs)
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    volumes = {v["secret"]["secretName"] for doc in docs for _, spec in pod_specs(doc)
               for v in spec.get("volumes", []) if "secret" in v}
    assert refs - generated == {"pd-secrets"} and volumes - generated == {"pd-secrets"}


def test_metadata_service_command_follows_etcd_settings() -> None:
    def args_of(values: dict) -> list[str]:
        deploy = one(render(values), "Deployment", f"{RELEASE}-pdcluster-metadata")
        return deploy["spec"]["template"]["spec"]["containers"][0]["args"]

    default = args_of({})
    assert "--backend=etcd" in default
    assert f"--etcd={RELEASE}-pdcluster-etcd.serving.svc.cluster.local:2379" in default
    external = args_of(VALUE_SETS["external-etcd"])
    assert "--etcd=etcd-0.infra:2379,etcd-1.infra:2379" in external
    memory = args_of(VALUE_SETS["memory-metadata"])
    assert "--backend=memory" in memory and not any(a.startswith("--etcd") for a in memory)
    deploy = one(render(VALUE_SETS["memory-metadata"]), "Deployment",
                 f"{RELEASE}-pdcluster-metadata")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"


def test_etcd_statefulset_members_and_storage() -> None:
    docs = render(VALUE_SETS["etcd-3-members"])
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    (initial,) = [a for a in args if a.startswith("--initial-cluster=")]
    members = initial.split("=", 1)[1].split(",")
    assert [m.split("=")[0] for m in members] == [f"{RELEASE}-pdcluster-etcd-{i}"
                                                  for i in range(3)]
    headless = one(docs, "Service", f"{RELEASE}-pdcluster-etcd-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert all(f".{RELEASE}-pdcluster-etcd-headless.serving.svc" in m for m in members)
    assert "--auto-compaction-mode=periodic" in args
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert not find(render(VALUE_SETS["external-etcd"]), "StatefulSet")


def test_router_command_env_and_service() -> None:
    docs = render(VALUE_SETS["ingress"])
    deploy = one(docs, "Deployment", f"{RELEASE}-pdcluster-router")
    (router,) = deploy["spec"]["template"]["spec"]["containers"]
    assert router["command"] == ["pdcluster"]
    assert router["args"][1:3] == ["router", "serve"]
    assert "--model=/models/Qwen2.5-7B-Instruct" in router["args"]
    assert ("--metadata=" + f"{RELEASE}-pdcluster-metadata.serving.svc.cluster.local:50061"
            in router["args"])
    # the router routes by the nodes' policy; it hashes prompts with the KV identity the
    # nodes register, so nothing passes it a block size or an engine to get wrong
    assert {"--local-prefill-threshold=256",
            "--global-reuse-min-tokens=512"} <= set(router["args"])
    assert not [a for a in router["args"] if a.startswith(("--block-size", "--engine"))]
    env = env_of(router)
    assert env["PDCLUSTER_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    # every replica salts tenants with the one key the chart generated and keeps
    salt = env["PDCLUSTER_CACHE_SALT_KEY"]["valueFrom"]["secretKeyRef"]
    assert salt == {"name": f"{RELEASE}-pdcluster-router-salt", "key": "cache-salt-key"}
    generated = one(docs, "Secret", salt["name"])
    assert len(generated["data"]["cache-salt-key"]) >= 64
    assert generated["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # the router holds its client credential, never the cluster secret
    assert env["PDCLUSTER_ROUTER_TOKEN_FILE"]["value"] \
        == "/var/run/secrets/pdcluster-router/router-token"
    assert "PDCLUSTER_CLUSTER_SECRET_FILE" not in env
    assert "--admin-port=9091" in router["args"]
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {"http": 8000,
                                                                        "admin": 9091}
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    ingress = one(docs, "Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-tls"
    assert not find(render(VALUE_SETS["no-ingress"]), "Ingress")
    assert not find(render(VALUE_SETS["no-ingress"]), "HorizontalPodAutoscaler")


def test_the_ingress_pins_each_tenant_to_one_router_replica() -> None:
    """Each router routes only on the claims it attested itself: the ingress hashes the API key
    so a tenant's requests meet the replica that placed its blocks; annotations given win."""
    hash_by = "nginx.ingress.kubernetes.io/upstream-hash-by"
    ingress = one(render(VALUE_SETS["ingress"]), "Ingress")
    assert ingress["metadata"]["annotations"][hash_by] == "$http_authorization"
    values = copy.deepcopy(VALUE_SETS["ingress"])
    values["router"]["ingress"]["tenantAffinity"] = False
    assert "annotations" not in one(render(values), "Ingress")["metadata"]
    values["router"]["ingress"].update(tenantAffinity=True, annotations={
        hash_by: "$http_x_tenant", "nginx.ingress.kubernetes.io/proxy-body-size": "8m"})
    annotations = one(render(values), "Ingress")["metadata"]["annotations"]
    assert annotations == {hash_by: "$http_x_tenant",
                           "nginx.ingress.kubernetes.io/proxy-body-size": "8m"}


def test_monitoring_objects() -> None:
    docs = render(VALUE_SETS["monitoring"])
    service_monitor = one(docs, "ServiceMonitor")
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert service_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    router_svc = one(docs, "Service", f"{RELEASE}-pdcluster-router")
    assert selects(service_monitor["spec"]["selector"]["matchLabels"],
                   router_svc["metadata"]["labels"])
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in router_svc["spec"]["ports"]}
    pod_monitor = one(docs, "PodMonitor", f"{RELEASE}-pdcluster-ray")
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    cluster = one(docs, "RayCluster")
    for where, c in containers([cluster]):
        assert pod_endpoint["port"] in {p["name"] for p in c["ports"]}, where
    assert sorted(monitored_components(pod_monitor)) == ["ray-decode", "ray-head",
                                                         "ray-prefill"]
    check_node_pod_monitor(docs, cluster)
    dashboard = one(docs, "ConfigMap", f"{RELEASE}-pdcluster-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdcluster.json"])["uid"] == "pdcluster-overview"
    assert not find(render({}), "ServiceMonitor") and not find(render({}), "PodMonitor")


def monitored_components(pod_monitor: dict) -> list[str]:
    return {e["key"]: e["values"] for e in pod_monitor["spec"]["selector"]
            ["matchExpressions"]}["app.kubernetes.io/component"]


def check_node_pod_monitor(docs: list[dict], cluster: dict) -> None:
    """The node actors' own /metrics: a named container port on every prefill and decode
    pod, the port cluster.yaml gives the nodes, and a PodMonitor scraping it."""
    nodes = one(docs, "PodMonitor", f"{RELEASE}-pdcluster-nodes")
    assert sorted(monitored_components(nodes)) == ["ray-decode", "ray-prefill"]
    (endpoint,) = nodes["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    port = cluster_config(docs)["node"]["metrics_port"]
    for where, c in containers([cluster]):
        if "head" not in where:
            assert {"name": endpoint["port"], "containerPort": port} in c["ports"], where


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((CHART / "dashboards" / "pdcluster.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    assert len(exprs) >= 10
    metrics = set()
    for expr in exprs:
        names = re.findall(r"\b(router_[a-z0-9_]+|ray_node_[a-z0-9_]+|pdcluster_node_[a-z0-9_]+"
                           r"|ray_pdcluster_planner_[a-z0-9_]+)", expr)
        assert names, expr
        metrics |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    return metrics


def test_dashboard_queries_the_documented_metrics() -> None:
    docs = (REPO_ROOT / "docs" / "deploy.md").read_text()
    undocumented = sorted(m for m in dashboard_metrics() if f"`{m}`" not in docs)
    assert not undocumented, f"dashboard metrics missing from docs/deploy.md: {undocumented}"


def test_dashboard_router_metrics_exist_in_the_router() -> None:
    from pdcluster.router.metrics import RouterMetrics

    exported = set(re.findall(r"^# TYPE (\S+) (\S+)$", RouterMetrics().render().decode(),
                              re.M))
    names = {name for name, _ in exported}
    # prometheus_client exposes a counter `x` as x_total, a histogram as x_bucket/_sum/_count.
    names |= {f"{name}_total" for name, kind in exported if kind == "counter"}
    missing = sorted(m for m in dashboard_metrics()
                     if m.startswith("router_") and m not in names)
    assert not missing, f"the dashboard queries metrics the router does not export: {missing}"


def test_dashboard_planner_metrics_are_the_planners() -> None:
    """Ray exports the planner actor's metrics with a `ray_` prefix, a counter as `_total`."""
    from pdcluster.cluster.planner_metrics import PLANNER_METRICS

    exported = {f"ray_{name}_total" if name.endswith("_events") else f"ray_{name}"
                for name in PLANNER_METRICS}
    queried = {m for m in dashboard_metrics() if m.startswith("ray_pdcluster_planner_")}
    assert len(queried) >= 4 and queried <= exported, queried - exported


def render_notes(values: dict, tmp_path: Path) -> str:
    """NOTES.txt as `helm install` would print it (helm template does not render it, and
    `helm install --dry-run` wants a cluster): rendered as a ConfigMap in a copy of the chart."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_test_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "{{- end -}}\n")
    (chart / "templates" / "test-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "test.notes" . | quote }}\n')
    path = write_values(with_metadata_transport_acknowledged(with_api_keys(values)), tmp_path)
    out = helm("template", RELEASE, str(chart), "--namespace", "serving", "-f", str(path),
               "--show-only", "templates/test-notes.yaml").stdout
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_tell_how_to_call_the_endpoint(tmp_path) -> None:
    notes = render_notes({"router": {"acknowledgeOpenApi": True}}, tmp_path)
    # the router also listens on its pod's loopback: port-forward reaches it
    assert f"port-forward svc/{RELEASE}-pdcluster-router 8000:8000" in notes
    assert "BASE=http://127.0.0.1:8000" in notes
    assert "/v1/chat/completions" in notes and "Authorization" not in notes
    assert "2 prefill + 2 decode" in notes and "TCP" in notes
    # bound to its pod IP only: no port-forward, a client pod calls the Service
    notes = render_notes({"router": {"acknowledgeOpenApi": True, "listenOnLoopback": False}},
                         tmp_path / "pod-ip")
    assert "port-forward svc/pd-pdcluster-router" not in notes
    assert "run pd-client --rm -it --restart=Never --image=curlimages/curl -- sh" in notes
    assert f"BASE=http://{RELEASE}-pdcluster-router.serving.svc.cluster.local:8000" in notes
    notes = render_notes(VALUE_SETS["ingress"], tmp_path / "ingress")
    assert "BASE=https://llm.example.org" in notes
    assert 'Authorization: Bearer $KEY' in notes
    assert f"secret {RELEASE}-pdcluster-secrets -o jsonpath='{{.data.api-keys}}'" in notes
    notes = render_notes(merged(VALUE_SETS["launcher-job"], VALUE_SETS["4x4"],
                                VALUE_SETS["rdma-on"]), tmp_path / "job")
    assert "logs -f job/pd-pdcluster-nodes-" in notes
    assert "4 prefill + 4 decode" in notes and "RDMA" in notes
    # bound to a wildcard by choice: port-forward works again
    notes = render_notes(VALUE_SETS["network-policy-off"], tmp_path / "wildcard")
    assert f"port-forward svc/{RELEASE}-pdcluster-router 8000:8000" in notes
    notes = render_notes({"router": {"apiKeys": ["sk-0123456789abcdef"],
                                     "listenOnLoopback": False}}, tmp_path / "keys")
    key_line = notes.index("KEY=$(kubectl")
    assert key_line < notes.index('--env="KEY=$KEY"') < notes.index("curl -s $BASE/health")


def test_dashboard_node_metrics_exist_on_the_nodes() -> None:
    from pdcluster.engine.core.outputs import EngineCounters, EngineLoad
    from pdcluster.node.metrics import NodeMetrics

    metrics = NodeMetrics("n0", "prefill")
    metrics.update(EngineCounters(EngineLoad(0, 0, 8, 8, 0), 0, 0, 0, 0.0, 0, 0, 0),
                   {"blocks_sent": 1})
    exported = set(re.findall(r"^# TYPE (\S+) (\S+)$", metrics.render().decode(), re.M))
    names = {name for name, _ in exported}
    names |= {f"{name}_total" for name, kind in exported if kind == "counter"}
    missing = sorted(m for m in dashboard_metrics()
                     if m.startswith("pdcluster_node_") and m not in names)
    assert not missing, f"the dashboard queries metrics the nodes do not export: {missing}"
