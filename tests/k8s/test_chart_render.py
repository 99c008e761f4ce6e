"""The chart renders valid manifests for every value set: `helm lint --strict`, Kubernetes
schemas (strict: unknown fields fail), KubeRay's CRD schemas, probes and resources on every
container, and the launcher's cluster.yaml."""

from __future__ import annotations

import re

import pytest

from tests.k8s.chart import (
    CHART,
    KUBE_VERSIONS,
    RELEASE,
    VALUE_SETS,
    chart_defaults,
    cluster_config,
    cluster_config_text,
    containers,
    env_of,
    helm,
    kuberay_validator,
    merged,
    needs_helm,
    one,
    render,
    validate_kubernetes,
    write_values,
)

pytestmark = needs_helm

SETS = sorted(VALUE_SETS)
CUSTOM_GROUPS = {"ray.io/v1", "monitoring.coreos.com/v1", "cert-manager.io/v1"}
CLUSTER_KEYS = {"model", "num_prefill", "num_decode", "engine", "transfer", "metadata", "router",
                "node", "host"}


def values_of(name: str) -> dict:
    return merged(chart_defaults(), VALUE_SETS[name])


@pytest.mark.parametrize("name", SETS)
def test_helm_lint_strict(name: str, tmp_path) -> None:
    path = write_values(VALUE_SETS[name], tmp_path)
    proc = helm("lint", "--strict", str(CHART), "-f", str(path), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", SETS)
def test_manifests_pass_kubernetes_schemas(name: str) -> None:
    docs = render(VALUE_SETS[name])
    failures = []
    for doc in docs:
        if doc["apiVersion"] in CUSTOM_GROUPS:
            continue
        for version in KUBE_VERSIONS:
            try:
                validate_kubernetes(doc, version)
            except Exception as exc:  # collect every failure, then report them together
                path = ".".join(str(p) for p in getattr(exc, "path", []))
                failures.append(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}) "
                                f"{path}: {getattr(exc, 'message', exc)}")
    assert not failures, "\n".join(failures)


def test_kubernetes_validator_rejects_unknown_and_mistyped_fields() -> None:
    """The validator used above is not a rubber stamp."""
    import jsonschema

    deploy = one(render({}), "Deployment", f"{RELEASE}-pdcluster-router")
    validate_kubernetes(deploy, KUBE_VERSIONS[0])
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="livenessprobe"):
        validate_kubernetes(deploy, KUBE_VERSIONS[0])
    del deploy["spec"]["template"]["spec"]["containers"][0]["livenessprobe"]
    deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(jsonschema.ValidationError, match="not of type 'integer'"):
        validate_kubernetes(deploy, KUBE_VERSIONS[-1])


@pytest.mark.parametrize("name", SETS)
def test_custom_resources_pass_kuberay_schemas(name: str) -> None:
    docs = render(VALUE_SETS[name])
    ray_docs = [d for d in docs if d["apiVersion"] == "ray.io/v1"]
    assert {d["kind"] for d in ray_docs} >= {"RayCluster"}
    failures = []
    for doc in ray_docs:
        for error in kuberay_validator(doc["kind"]).iter_errors(doc):
            where = ".".join(str(p) for p in error.absolute_path)
            failures.append(f"{doc['kind']}/{doc['metadata']['name']} {where}: {error.message}")
    assert not failures, "\n".join(failures)


def test_kuberay_validator_rejects_unknown_and_mistyped_fields() -> None:
    """The strict CRD validator used above is not a rubber stamp."""
    cluster = one(render({}), "RayCluster")
    validator = kuberay_validator("RayCluster")
    assert not list(validator.iter_errors(cluster))
    cluster["spec"]["workerGroupSpecs"][0]["replicaz"] = 2
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    messages = [e.message for e in validator.iter_errors(cluster)]
    assert any("replicaz" in m for m in messages), messages
    assert any("is not of type 'string'" in m for m in messages), messages


@pytest.mark.parametrize("name", SETS)
def test_every_container_has_probes(name: str) -> None:
    docs = render(VALUE_SETS[name])
    found = list(containers(docs))
    assert len(found) >= 5  # head, prefill, decode, metadata, router (+ etcd, launcher Job)
    # (the etcd-setup hook Job runs one command to completion: nothing to probe)
    missing = [where for where, c in found
               if ("livenessProbe" not in c or "readinessProbe" not in c)
               and not where.endswith("-etcd-setup/etcd-setup")]
    assert not missing, f"containers without liveness and readiness probes: {missing}"
    # Init containers may not carry probes (the API server refuses them).
    probed_inits = [where for where, c in containers(docs, init=True)
                    if {"livenessProbe", "readinessProbe", "startupProbe"} & set(c)]
    assert not probed_inits, probed_inits


@pytest.mark.parametrize("name", SETS)
def test_every_container_has_requests_and_limits(name: str) -> None:
    docs = render(VALUE_SETS[name])
    bad = []
    for where, c in [*containers(docs), *containers(docs, init=True)]:
        resources = c.get("resources", {})
        for kind in ("requests", "limits"):
            if not {"cpu", "memory"} <= set(resources.get(kind, {})):
                bad.append(f"{where}: {kind} {resources.get(kind)}")
    assert not bad, "\n".join(bad)


def test_vllm_backend_runs_vllms_image_and_options_everywhere_it_matters() -> None:
    """backend: vllm reaches the nodes (cluster.yaml, with vLLM's own options), their image
    (the Ray pods and the launcher) and the router (it hashes prompts as vLLM does)."""
    docs = render({"cluster": {"engine": {"backend": "vllm", "gpuMemoryUtilization": 0.8}}})
    engine = cluster_config(docs)["engine"]
    assert engine["backend"] == "vllm"
    assert "tensor_parallel_size" not in engine  # per role: cluster.node.tensorParallelSize
    assert engine["gpu_memory_utilization"] == 0.8
    from pdcluster.engine.config import EngineConfig

    EngineConfig.from_options("/models/m", engine)  # what the nodes build from it
    images = {c["image"] for _, c in containers(docs) if "/node" in c["image"]}
    assert images and all("pdcluster/node-vllm:" in image for image in images), images
    # the router takes vLLM's block size and hash scheme from the nodes' registrations:
    # nothing tells it the engine (`router serve` refuses --engine and --block-size)
    router_args = [a for _, c in containers(docs) for a in c.get("args", [])
                   if a.startswith(("--engine=", "--block-size="))]
    assert router_args == []


@pytest.mark.parametrize("name", SETS)
def test_cluster_yaml(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    config = cluster_config(docs)
    assert set(config) == CLUSTER_KEYS
    assert set(config["engine"]) == {"backend", "dtype", "block_size", "max_num_seqs",
                                     "max_num_batched_tokens", "max_model_len"}
    assert config["engine"]["backend"] == "pdcluster"
    assert set(config["transfer"]) == {"protocol", "device_name", "timeout_s"}
    assert set(config["node"]) == {"gpus", "max_restarts", "local_prefill_threshold_tokens",
                                   "global_reuse_min_tokens", "role_resource_prefix",
                                   "metrics_port", "request_port", "request_ports",
                                   "tensor_parallel_size"}
    assert config["node"]["tensor_parallel_size"] == \
        values["cluster"]["node"]["tensorParallelSize"]
    assert config["node"]["metrics_port"] == values["cluster"]["node"]["metricsPort"]
    # one request port per node actor of a pod, from cluster.node.requestPort on
    assert config["node"]["request_port"] == values["cluster"]["node"]["requestPort"]
    node = values["cluster"]["node"]
    per_pod = max(1, *(values["ray"][role]["gpusPerPod"]
                       // (node["gpus"] * node["tensorParallelSize"][role])
                       for role in ("prefill", "decode")))
    assert config["node"]["request_ports"] == per_pod
    assert config["node"]["role_resource_prefix"] == values["ray"]["groupResourcePrefix"]
    assert config["host"] == "auto"  # nodes bind and publish their pod's IP
    assert config["model"] == f"/models/{values['model']['name']}"
    for role in ("prefill", "decode"):
        group = values["ray"][role]
        per_node = values["cluster"]["node"]["gpus"] \
            * values["cluster"]["node"]["tensorParallelSize"][role]
        assert config[f"num_{role}"] == group["replicas"] * group["gpusPerPod"] // per_node
    rdma = values["rdma"]
    assert config["transfer"] == {"protocol": "rdma" if rdma["enabled"] else "tcp",
                                  "device_name": rdma["deviceName"] if rdma["enabled"] else "",
                                  "timeout_s": values["cluster"]["transfer"]["timeoutS"]}
    assert config["engine"]["dtype"] == values["cluster"]["engine"]["dtype"]
    assert config["engine"]["max_model_len"] is None
    # The router runs as its own Deployment, so the launcher starts none (and binds nothing).
    assert config["router"] == {"host": "127.0.0.1", "port": values["router"]["port"],
                                "enabled": False}
    # The metadata address is the metadata Service's in-cluster name and port.
    service = one(docs, "Service", f"{RELEASE}-pdcluster-metadata")
    host, port = config["metadata"]["address"].rsplit(":", 1)
    assert host.startswith(f"{service['metadata']['name']}.serving.svc.")
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert "token" not in config["metadata"]  # credentials stay in the Secret
    # no secret's value (file paths under /var/run/secrets name where TLS files are mounted)
    assert "secret" not in cluster_config_text(docs).replace("/var/run/secrets/", "/")


@pytest.mark.parametrize("backend", ["pdcluster", "vllm"])
def test_tensor_parallel_size_per_role_sets_node_counts_and_each_actors_gpus(backend) -> None:
    """Prefill at TP=4 and decode at TP=2 on 8-GPU pods, either engine: two prefill and four
    decode actors a pod, each asking the launcher for a GPU per rank (all on its pod)."""
    from pdcluster.cluster.config import ClusterConfig

    docs = render({"cluster": {"engine": {"backend": backend},
                               "node": {"tensorParallelSize": {"prefill": 4, "decode": 2}}},
                   "ray": {"prefill": {"replicas": 1, "gpusPerPod": 8},
                           "decode": {"replicas": 2, "gpusPerPod": 8}}})
    config = cluster_config(docs)
    assert (config["num_prefill"], config["num_decode"]) == (2, 8)
    parsed = ClusterConfig.from_dict(config)
    assert (parsed.node_gpus_of("prefill"), parsed.node_gpus_of("decode")) == (4, 2)
    assert parsed.engine_options("prefill")["tensor_parallel_size"] == 4
    assert parsed.engine_options("decode")["tensor_parallel_size"] == 2
    assert parsed.engine_options("decode")["backend"] == backend


def test_cluster_yaml_max_model_len_and_engine_values() -> None:
    docs = render({"cluster": {"engine": {"maxModelLen": 8192, "dtype": "float16",
                                          "maxNumSeqs": 128}, "node": {"maxRestarts": -1}}})
    config = cluster_config(docs)
    assert config["engine"]["max_model_len"] == 8192
    assert config["engine"]["dtype"] == "float16"
    assert config["engine"]["max_num_seqs"] == 128
    assert config["node"]["max_restarts"] == -1


@pytest.mark.parametrize("name", SETS)
def test_worker_groups(name: str) -> None:
    values = values_of(name)
    cluster = one(render(VALUE_SETS[name]), "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    rdma = values["rdma"]
    for role, group in groups.items():
        wanted = values["ray"][role]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] \
            == wanted["replicas"]
        params = group["rayStartParams"]
        assert params["num-gpus"] == str(wanted["gpusPerPod"])
        assert params["resources"] == f'"{{\\"pdcluster_{role}\\": {wanted["gpusPerPod"]}}}"'
        spec = group["template"]["spec"]
        (worker,) = spec["containers"]
        resources = worker["resources"]
        for kind in ("requests", "limits"):
            assert resources[kind]["nvidia.com/gpu"] == wanted["gpusPerPod"]
            assert (rdma["resourceName"] in resources[kind]) == rdma["enabled"]
        caps = worker.get("securityContext", {}).get("capabilities", {}).get("add", [])
        assert caps == (rdma["capabilities"] if rdma["enabled"] else [])
        assert spec.get("hostNetwork", False) == (rdma["enabled"] and rdma["hostNetwork"])
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": wanted["shmSize"]}
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
        assert env_of(worker)["PDCLUSTER_ROLE"]["value"] == role
        annotations = group["template"]["metadata"].get("annotations", {})
        for key, value in (rdma["podAnnotations"] if rdma["enabled"] else {}).items():
            assert annotations[key] == value
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # no node actor on the head
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    auth = cluster["spec"].get("authOptions")
    if values["ray"]["auth"]["enabled"]:
        assert auth == {"mode": "token", "secretName": values["secrets"]["existingSecret"]
                        or f"{RELEASE}-pdcluster-secrets"}
    else:
        assert auth is None


def _launch_hash(docs: list[dict]) -> str:
    first_line = cluster_config_text(docs).splitlines()[0]
    match = re.fullmatch(r"# pdcluster-launch: ([0-9a-f]{16})", first_line)
    assert match, first_line
    return match.group(1)


@pytest.mark.parametrize("name", SETS)
def test_launcher(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    cluster_name = one(docs, "RayCluster")["metadata"]["name"]
    stamp = _launch_hash(docs)
    launch = "exec python -m pdcluster.cluster.launch --config /etc/pdcluster/cluster.yaml'"
    jobs = [d for d in docs if d["kind"] == "Job"
            and "helm.sh/hook" not in d["metadata"].get("annotations", {})]  # etcd-setup
    ray_jobs = [d for d in docs if d["kind"] == "RayJob"]
    if values["launcher"]["mode"] == "rayjob":
        assert not jobs
        (ray_job,) = ray_jobs
        spec = ray_job["spec"]
        assert spec["clusterSelector"] == {"ray.io/cluster": cluster_name}
        assert "rayClusterSpec" not in spec and not spec.get("shutdownAfterJobFinishes")
        assert spec["submissionMode"] == values["launcher"]["rayJob"]["submissionMode"]
        entrypoint, name_ = spec["entrypoint"], ray_job["metadata"]["name"]
    else:
        assert not ray_jobs
        (job,) = jobs
        (container,) = job["spec"]["template"]["spec"]["containers"]
        env = env_of(container)
        assert env["RAY_ADDRESS"]["value"].startswith(f"http://{cluster_name}-head-svc.serving.")
        assert env["RAY_ADDRESS"]["value"].endswith(":8265")
        assert env["PDCLUSTER_SUBMISSION_ID"]["value"] == job["metadata"]["name"]
        assert job["metadata"]["name"].startswith(env["PDCLUSTER_SUBMISSION_PREFIX"]["value"])
        assert env["PDCLUSTER_WORKING_DIR"]["value"] == values["launcher"]["job"]["workingDir"]
        assert container["command"] == ["python", "/etc/pdcluster/launch_nodes.py"]
        assert ("RAY_AUTH_TOKEN" in env) == values["ray"]["auth"]["enabled"]
        entrypoint, name_ = env["PDCLUSTER_ENTRYPOINT"]["value"], job["metadata"]["name"]
    assert entrypoint.startswith("sh -c '") and entrypoint.endswith(launch)
    assert entrypoint.count("'") == 2  # one single-quoted script: see pdcluster.launchEntrypoint
    assert f'"# pdcluster-launch: {stamp}"' in entrypoint
    assert name_.endswith(stamp[:10])


def launch_name(values: dict) -> str:
    docs = render(values)
    (launcher,) = [d for d in docs if d["kind"] in ("RayJob", "Job")
                   and not d["metadata"]["name"].endswith("-etcd-setup")]
    return launcher["metadata"]["name"]


@pytest.mark.parametrize("change", [
    {"cluster": {"engine": {"maxNumSeqs": 32}}},  # cluster.yaml
    {"images": {"node": {"tag": "0.1.1"}}},  # the Ray pods are recreated
    {"ray": {"decode": {"replicas": 3}}},
    {"launcher": {"generation": 1}},  # by hand
])
def test_launch_is_renewed_when_the_nodes_must_start_again(change: dict) -> None:
    assert launch_name(change) != launch_name({})


@pytest.mark.parametrize("change", [
    {"router": {"replicas": 5, "hpa": {"enabled": False}}},
    {"metadata": {"replicas": 3}},
    {"etcd": {"storage": {"size": "20Gi"}}},
    {"launcher": {"mode": "job"}},
])
def test_launch_is_kept_when_the_nodes_are_unaffected(change: dict) -> None:
    assert launch_name(change) == launch_name({})


def test_ray_upgrade_strategy() -> None:
    assert one(render({}), "RayCluster")["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    cluster = one(render({"ray": {"upgradeStrategy": "None"}}), "RayCluster")
    assert "upgradeStrategy" not in cluster["spec"]


@pytest.mark.parametrize("name", SETS)
def test_every_pod_runs_offline_and_only_init_containers_download(name: str) -> None:
    values = values_of(name)
    docs = render(VALUE_SETS[name])
    for where, c in containers(docs):
        if c["name"] in ("etcd", "launcher"):
            continue
        assert env_of(c)["HF_HUB_OFFLINE"]["value"] == "1", where
    inits = dict(containers(docs, init=True))
    if values["model"]["source"] == "pvc":
        assert not inits
        return
    # hub: the head and the router fetch config + tokenizer only, GPU workers the weights too.
    assert len(inits) == 4, sorted(inits)
    for where, c in inits.items():
        env = env_of(c)
        assert c["command"] == ["python", "/etc/pdcluster/download_model.py"]
        assert env["HF_HUB_OFFLINE"]["value"] == "0"  # the image's default is offline
        assert env["PDCLUSTER_MODEL_REPO"]["value"] == values["model"]["hub"]["repo"]
        assert env["PDCLUSTER_MODEL_DIR"]["value"] == f"/models/{values['model']['name']}"
        patterns = env["PDCLUSTER_MODEL_PATTERNS"]["value"]
        assert (patterns == "") == ("/prefill/" in where or "/decode/" in where), where
        if values["model"]["hub"]["tokenSecret"]["name"]:
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"


@pytest.mark.parametrize("name", SETS)
def test_ray_pods_mount_config_model_and_shm(name: str) -> None:
    docs = render(VALUE_SETS[name])
    cluster = one(docs, "RayCluster")
    values = values_of(name)
    for where, c in containers([cluster]):
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {"/dev/shm", "/etc/pdcluster", "/models", "/tmp/ray"} <= set(mounts), where
        # the cluster secret on the head only (the launcher's driver): no worker holds it,
        # and with pod identity not even the head (its nodes trade their pods' tokens)
        on_head = where.endswith("/head/ray-head")
        pod_identity = values["metadata"]["podIdentity"]["enabled"]
        assert ("/var/run/secrets/pdcluster" in mounts) == (on_head and not pod_identity)
        assert mounts["/models"]["readOnly"] == (values["model"]["source"] == "pvc")


def test_host_cache_reaches_the_nodes_engine_options() -> None:
    """cluster.engine.hostCacheGiB becomes the nodes' host_cache_gib (absent when 0)."""
    from pdcluster.engine.config import EngineConfig

    engine = cluster_config(render({"cluster": {"engine": {"hostCacheGiB": 24}}}))["engine"]
    assert engine["host_cache_gib"] == 24
    assert EngineConfig.from_options("/models/m", engine).has_host_tier
    assert "host_cache_gib" not in cluster_config(render({}))["engine"]


def test_disk_cache_reaches_the_nodes_engine_options() -> None:
    """cluster.engine.diskCacheGiB becomes the nodes' disk_cache_gib (absent when 0)."""
    from pdcluster.engine.config import EngineConfig

    engine = cluster_config(render({"cluster": {"engine": {"hostCacheGiB": 4,
                                                           "diskCacheGiB": 64}}}))["engine"]
    assert engine["disk_cache_gib"] == 64
    assert EngineConfig.from_options("/models/m", engine).has_disk_tier
    assert "disk_cache_gib" not in cluster_config(render({}))["engine"]
