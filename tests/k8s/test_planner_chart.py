"""The chart with `planner.enabled` (issue 37): Ray's in-tree autoscaler on, each worker group
between its min and max replicas, cluster.yaml's `planner:` section (node-actor bounds from
the pod bounds, the router's admin Service to read signals from) accepted by the launcher's
own parser, the planner let through the router's network policy; and the refusals."""

from __future__ import annotations

import pytest

from pdcluster.cluster.planner_settings import PlannerSettings
from tests.k8s.chart import cluster_config, kuberay_validator, needs_helm, one, render, template

pytestmark = needs_helm

PLANNER = {"planner": {"enabled": True, "sloItlMs": 40},
           "router": {"replicas": 1, "hpa": {"enabled": False}},
           "ray": {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3},
                   "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6,
                              "gpusPerPod": 2}},
           "networkPolicy": {"enabled": True, "rayDashboardFrom": [{"podSelector": {}}]}}


def test_planner_turns_the_autoscaler_on_within_the_groups_bounds() -> None:
    docs = render(PLANNER)
    ray = one(docs, "RayCluster")
    assert ray["spec"]["enableInTreeAutoscaling"] is True
    assert ray["spec"]["autoscalerOptions"] == {"idleTimeoutSeconds": 60}
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (1, 3)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 6)
    validator = kuberay_validator("RayCluster")
    if validator is not None:
        validator.validate(ray)


def test_cluster_yaml_carries_the_planner_for_the_launcher() -> None:
    section = cluster_config(render(PLANNER))["planner"]
    settings = PlannerSettings.from_dict(section)
    assert settings is not None and settings.slo_itl_ms == 40
    # node actors: pods x GPUs per pod / GPUs per node actor (1)
    assert (settings.min_prefill, settings.max_prefill) == (1, 3)
    assert (settings.min_decode, settings.max_decode) == (2, 12)
    assert settings.router_url == "http://pd-pdcluster-router:9091"


def test_the_router_admits_the_planner_on_its_admin_port() -> None:
    policy = one(render(PLANNER), "NetworkPolicy", "pd-pdcluster-router")
    admin = [rule for rule in policy["spec"]["ingress"]
             if rule["ports"][0]["port"] == 9091]
    sources = [s.get("podSelector", {}).get("matchLabels", {}).get(
        "app.kubernetes.io/component") for rule in admin for s in rule["from"]]
    assert {"ray-head", "ray-prefill", "ray-decode"} <= set(sources)


def test_without_the_planner_the_groups_stay_fixed() -> None:
    docs = render({})
    ray = one(docs, "RayCluster")
    assert ray["spec"]["enableInTreeAutoscaling"] is False
    for group in ray["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]
    assert "planner" not in cluster_config(docs)


@pytest.mark.parametrize("values, message", [
    ({"router": {"replicas": 2}}, "one router"),
    ({"ray": {"decode": {"replicas": 2, "maxReplicas": 1}}}, "minReplicas <= replicas"),
])
def test_planner_refusals(values, message) -> None:
    merged = {**PLANNER, **values}
    if "ray" in values:
        merged["ray"] = {**PLANNER["ray"], **values["ray"]}
    result = template(merged, check=False)
    assert result.returncode != 0 and message in result.stderr
