"""Bad values are refused before anything renders: by values.schema.json (helm validates values
against it on lint, template, install and upgrade), or, for rules across values that a JSON
schema cannot state, by the chart's own checks (templates/validate.yaml)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.k8s.chart import CHART, VALUE_SETS, chart_defaults, merged, needs_helm, template

# (values, a fragment of helm's error message)
BAD_VALUES = {
    "unknown top-level key": ({"routr": {"replicas": 2}}, "routr"),
    "negative host tier": ({"cluster": {"engine": {"hostCacheGiB": -1}}},
                           "/cluster/engine/hostCacheGiB"),
    "negative disk tier": ({"cluster": {"engine": {"diskCacheGiB": -1}}},
                           "/cluster/engine/diskCacheGiB"),
    "misspelled nested key": ({"ray": {"prefill": {"replica": 2}}}, "replica"),
    "launcher mode": ({"launcher": {"mode": "cronjob"}}, "/launcher/mode"),
    "zero prefill pods": ({"ray": {"prefill": {"replicas": 0}}}, "/ray/prefill/replicas"),
    "gpus as a string": ({"ray": {"decode": {"gpusPerPod": "one"}}}, "/ray/decode/gpusPerPod"),
    "engine dtype": ({"cluster": {"engine": {"dtype": "int4"}}}, "/cluster/engine/dtype"),
    "negative threshold": ({"cluster": {"node": {"localPrefillThresholdTokens": -1}}},
                           "localPrefillThresholdTokens"),
    "port out of range": ({"router": {"port": 70000}}, "/router/port"),
    "bad memory quantity": ({"ray": {"head": {"resources": {"limits": {"memory": "8 GB"}}}}},
                            "/ray/head/resources/limits/memory"),
    "model name with a slash": ({"model": {"name": "../etc"}}, "/model/name"),
    "hub without repo": ({"model": {"source": "hub"}}, "/model/hub/repo"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source"),
    "memory backend with replicas": ({"metadata": {"backend": "memory", "replicas": 2}},
                                     "/metadata/replicas"),
    "no etcd at all": ({"etcd": {"enabled": False}}, "/etcd/externalEndpoints"),
    "etcd endpoint without port": ({"etcd": {"enabled": False,
                                             "externalEndpoints": ["etcd.infra"]}},
                                   "/etcd/externalEndpoints/0"),
    "even etcd members": ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    "lease ttl": ({"metadata": {"leaseTtlSeconds": 0}}, "/metadata/leaseTtlSeconds"),
    "ingress without host": ({"router": {"ingress": {"enabled": True, "host": ""}}},
                             "/router/ingress/host"),
    "rdma without resource": ({"rdma": {"enabled": True, "resourceName": ""}},
                              "/rdma/resourceName"),
    "short cluster secret": ({"secrets": {"clusterSecret": "ab" * 31}},
                             "/secrets/clusterSecret"),
    "cluster secret not hex": ({"secrets": {"clusterSecret": "zz" * 32}},
                               "/secrets/clusterSecret"),
    "cluster secret odd length": ({"secrets": {"clusterSecret": "a" * 65}},
                                  "/secrets/clusterSecret"),
    "the old metadata token": ({"secrets": {"metadataToken": "m" * 32}}, "metadataToken"),
    "router host not an address": ({"router": {"host": "0.0.0.0; rm -rf /"}}, "/router/host"),
    "network policy peer typo": ({"networkPolicy": {"routerIngressFrom": [
        {"namespaceSelectr": {}}]}}, "namespaceSelectr"),
    "network policy ipBlock beside a selector": ({"networkPolicy": {"metricsFrom": [
        {"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}, "/networkPolicy/metricsFrom/0"),
    "node CIDR without a prefix": ({"networkPolicy": {"nodeCIDRs": ["10.0.0.0"]}},
                                   "/networkPolicy/nodeCIDRs/0"),
    "api key with a comma": ({"router": {"apiKeys": ["sk-0123456789abcdef,x"]}},
                             "/router/apiKeys/0"),
    "submission mode": ({"launcher": {"rayJob": {"submissionMode": "SidecarModee"}}},
                        "submissionMode"),
    "pdb percentage": ({"pdb": {"maxUnavailable": "150%"}}, "/pdb/maxUnavailable"),
    "an engine backend not built": ({"cluster": {"engine": {"backend": "sglang"}}},
                                    "/cluster/engine/backend"),
    # one tensor-parallel setting for both engines: cluster.node.tensorParallelSize
    "a tensor-parallel size in the engine section": (
        {"cluster": {"engine": {"tensorParallelSize": 2}}}, "tensorParallelSize"),
    "a tensor-parallel size of a role not served": (
        {"cluster": {"node": {"tensorParallelSize": {"prefill": 1, "decode": 1, "both": 2}}}},
        "/cluster/node/tensorParallelSize"),
    "a tensor-parallel size of 0": (
        {"cluster": {"node": {"tensorParallelSize": {"prefill": 0, "decode": 1}}}},
        "/cluster/node/tensorParallelSize/prefill"),
    "hpa target": ({"router": {"hpa": {"targetCPUUtilizationPercentage": 0}}},
                   "targetCPUUtilizationPercentage"),
    "toleration effect": ({"ray": {"prefill": {"tolerations": [{"key": "a",
                                                                "effect": "NoSchedul"}]}}},
                          "effect"),
}

# Rules across values, checked by templates/validate.yaml (and the node-count helper).
BAD_COMBINATIONS = {
    "a host tier on vLLM nodes": ({"cluster": {"engine": {"backend": "vllm",
                                                          "hostCacheGiB": 8}}},
                                  "hostCacheGiB is the own engine's KV host tier"),
    "a disk tier on vLLM nodes": ({"cluster": {"engine": {"backend": "vllm",
                                                          "diskCacheGiB": 8}}},
                                  "diskCacheGiB is the own engine's KV disk tier"),
    "a disk tier without a host tier": ({"cluster": {"engine": {"diskCacheGiB": 8}}},
                                        "diskCacheGiB needs cluster.engine.hostCacheGiB"),
    "hpa min above max": ({"router": {"hpa": {"minReplicas": 9, "maxReplicas": 4}}},
                          "minReplicas (9) must not exceed maxReplicas (4)"),
    "GPUs not a multiple of a node's": ({"cluster": {"node": {"gpus": 2}},
                                         "ray": {"prefill": {"replicas": 3}}},
                                        "must be a multiple of cluster.node.gpus"),
    "a tensor-parallel group across pods": (
        {"cluster": {"node": {"tensorParallelSize": {"prefill": 2, "decode": 1}}}},
        "a tensor-parallel group never spans pods"),
    "api keys beside an existing secret": ({"secrets": {"existingSecret": "mine"},
                                            "router": {"apiKeys": ["sk-0123456789abcdef"]}},
                                           "router.apiKeys is ignored"),
    "host network without rdma": ({"rdma": {"hostNetwork": True}}, "rdma.hostNetwork needs"),
    "host network without node CIDRs": ({"rdma": {"enabled": True, "hostNetwork": True}},
                                        "needs networkPolicy.nodeCIDRs"),
    "RayJob without the operator's access": ({"networkPolicy": {"rayDashboardFrom": []}},
                                             "networkPolicy.rayDashboardFrom is empty"),
}


@needs_helm
@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects(case: str) -> None:
    values, fragment = BAD_VALUES[case]
    proc = template(values, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert fragment in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize("case", sorted(BAD_COMBINATIONS))
def test_chart_checks_reject(case: str) -> None:
    values, fragment = BAD_COMBINATIONS[case]
    proc = template(values, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert fragment in proc.stderr, proc.stderr


def schema_validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_schema_is_valid_and_accepts_every_value_set() -> None:
    """The schema itself, without helm: the defaults and every tested value set pass."""
    validator = schema_validator()
    for name, values in VALUE_SETS.items():
        errors = [e.message for e in validator.iter_errors(merged(chart_defaults(), values))]
        assert not errors, f"{name}: {errors}"


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects_without_helm(case: str) -> None:
    """The same bad values against the schema alone (runs where helm is missing)."""
    values, _ = BAD_VALUES[case]
    assert list(schema_validator().iter_errors(merged(chart_defaults(), values))), case


def test_every_default_value_is_described_by_the_schema() -> None:
    """additionalProperties is false everywhere the values are a fixed record: a key added to
    values.yaml without the schema fails here, not at a user's install."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values: dict, node: dict, path: str) -> None:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        assert node.get("type") == "object", f"{path}: not an object in the schema"
        props = node.get("properties")
        if props is None:
            return  # a free-form map (labels, annotations, nodeSelector)
        assert node.get("additionalProperties") is False, f"{path}: accepts unknown keys"
        for key, value in values.items():
            assert key in props, f"{path}.{key} is not in values.schema.json"
            if isinstance(value, dict) and value:
                walk(value, props[key], f"{path}.{key}")

    walk(chart_defaults(), schema, "values")
