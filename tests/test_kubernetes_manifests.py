"""deploy/kubernetes/: every manifest loads into the official ``kubernetes`` client's models
(pydantic: a wrong type is refused) and back unchanged (a misspelt field would be
dropped), and the references between them hold: selectors select pods, ports are
declared, secrets and their keys exist, the router's config is one the router loads,
each agent has its own NATS user in deploy/nats.conf with the password its Secret holds.
No cluster runs here: these are the checks a cluster would make, and the ones it would
only fail at run time.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / "deploy" / "kubernetes"
CORE = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}
# the Gateway API inference extension's v1 InferencePool (api/v1/inferencepool_types.go)
POOL_SPEC = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
PICKER_REF = {"group", "kind", "name", "port", "failureMode"}


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    files = sorted(p.name for p in DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files  # every file applied, none missing
    return [d for f in files for d in yaml.safe_load_all((DIR / f).read_text()) if d]


DOCS = documents()


def find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    found = [d for d in DOCS if d["kind"] == kind]
    return [d for d in found if d["metadata"]["name"] == name] if name else found


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = find(kind, name)
    return doc


def workloads() -> list[dict[str, Any]]:
    return find("Deployment") + find("StatefulSet")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector(text: str) -> dict[str, str]:
    return dict(term.split("=", 1) for term in text.split(",") if term)


def pods_of(selector: dict[str, str]) -> list[dict[str, Any]]:
    """The pod templates a selector picks."""
    return [w["spec"]["template"] for w in workloads()
            if selects(selector, w["spec"]["template"]["metadata"]["labels"])]  # fmt: skip


def container_ports(template: dict[str, Any]) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for c in template["spec"]["containers"]:
        for p in c.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


def nats_users() -> dict[str, tuple[str, str]]:
    """deploy/nats.conf's users: name -> (password, the text of their permissions)."""
    text = (ROOT / "deploy" / "nats.conf").read_text()
    found = list(re.finditer(r"user: ([\w-]+), password: ([\w-]+)", text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return {m.group(1): (m.group(2), text[m.end() : e]) for m, e in zip(found, ends, strict=True)}


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if d["apiVersion"] in CORE], ids=lambda d: d["metadata"]["name"]
)
def test_core_objects_load_into_the_client_models_and_back_unchanged(doc):
    api = client.ApiClient()
    model = api.deserialize(json.dumps(doc), f"V1{doc['kind']}", "application/json")
    assert type(model).__name__ == f"V1{doc['kind']}"
    assert api.sanitize_for_serialization(model) == doc


def test_workload_selectors_services_and_ports():
    for w in workloads():
        spec = w["spec"]
        assert selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
        if w["kind"] == "StatefulSet":
            service = one("Service", spec["serviceName"])
            assert service["spec"].get("clusterIP") == "None" or w["metadata"]["name"] == "nats"
    for service in find("Service"):
        pods = pods_of(service["spec"]["selector"])
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in pods:
                assert port.get("targetPort", port["port"]) in container_ports(pod)


def test_secret_config_map_and_account_references_exist():
    secrets = {s["metadata"]["name"]: s.get("stringData", {}) for s in find("Secret")}
    maps = {m["metadata"]["name"]: m["data"] for m in find("ConfigMap")}
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        if "serviceAccountName" in pod:
            assert find("ServiceAccount", pod["serviceAccountName"])
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
        for c in pod["containers"] + pod.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]
    binding = one("RoleBinding", "cache-router-discovery")
    role = one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    (subject,) = binding["subjects"]
    assert find("ServiceAccount", subject["name"])
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def router() -> dict[str, Any]:
    return one("Deployment", "cache-router")


def router_toml() -> dict[str, Any]:
    return tomllib.loads(one("ConfigMap", "cache-router-config")["data"]["router.toml"])


def test_the_router_config_is_one_the_router_loads_and_matches_the_cluster(tmp_path):
    from router.config import ENV_PREFIX, SCALARS, load_config
    from router.http.serve import add_arguments

    text = one("ConfigMap", "cache-router-config")["data"]["router.toml"]
    (tmp_path / "router.toml").write_text(text)
    cfg = load_config(str(tmp_path / "router.toml"), env={})
    container = router()["spec"]["template"]["spec"]["containers"][0]
    ports = container_ports(router()["spec"]["template"])
    assert ports["http"] == cfg.port and ports["epp"] == cfg.epp_port
    # the arguments are serve's, the config file the mounted one

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert args.config == f"{mount['mountPath']}/router.toml"
    for env in container["env"]:
        assert env["name"].startswith(ENV_PREFIX)
        assert env["name"].removeprefix(ENV_PREFIX).lower() in SCALARS
    # NATS: the Service and port; the router's user with the password of its Secret
    host, port = cfg.nats_url.removeprefix("nats://").split(":")
    assert any(p["port"] == int(port) for p in one("Service", host)["spec"]["ports"])
    password, perms = nats_users()[cfg.nats_user]
    secret = one("Secret", "cache-router-nats")["stringData"]["password"]
    assert secret == password and "kv.events.>" in perms
    # each discovery source selects engine pods that serve on its port
    assert cfg.kubernetes
    for source in cfg.kubernetes:
        pods = pods_of(label_selector(source.selector))
        assert pods, source.selector
        for pod in pods:
            annotated = int(pod["metadata"]["annotations"]["cache-router.io/port"])
            assert annotated in container_ports(pod)
            assert source.port == annotated
    # the EPP's liveness probe asks a service the EPP's health answers
    assert container["livenessProbe"]["grpc"] == {"port": cfg.epp_port, "service": "liveness"}


def test_each_agent_has_its_own_nats_user_and_password():
    users = nats_users()
    passwords = one("Secret", "nats-agents")["stringData"]
    from agent.main import add_arguments

    agents = 0
    for sts in find("StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        agent = next((c for c in pod["containers"] if c["name"] == "agent"), None)
        if agent is None:
            continue
        engine = pod["containers"][0]
        mount = next(m for m in agent["volumeMounts"] if m["name"] == "nats-agent")
        for i in range(sts["spec"]["replicas"]):
            name = f"{sts['metadata']['name']}-{i}"  # the pod's name: its worker id
            password, perms = users[f"agent-{name}"]
            assert passwords[name] == password
            assert f'"kv.events.{name}"' in perms and f'"kv.load.{name}"' in perms
            # the command, as the shell would run it in that pod, is the agent's
            line = agent["args"][0].replace("$POD_NAME", name)
            line = line.replace(f"$(cat {mount['mountPath']}/{name})", password)
            words = shlex.split(line)
            assert words[:3] == ["exec", "cache-router", "agent"]

            parser = argparse.ArgumentParser()
            add_arguments(parser)
            args = parser.parse_args(words[3:])
            assert args.worker_id == name and args.nats_user == f"agent-{name}"
            port = int(args.zmq_endpoint.rpartition(":")[2])
            assert port in container_ports(sts["spec"]["template"])
            assert args.engine_url.endswith(":8000")
            assert any("5557" in a for a in engine["args"])
            agents += 1
    assert agents == 4


def test_the_inference_pool_its_picker_and_route():
    (pool,) = find("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= POOL_SPEC and set(spec["endpointPickerRef"]) <= PICKER_REF
    engines = pods_of(spec["selector"]["matchLabels"])
    assert {p["metadata"]["labels"]["app.kubernetes.io/name"] for p in engines} == {
        "vllm",
        "sglang",
    }
    for pod in engines:
        for port in spec["targetPorts"]:
            assert port["number"] in container_ports(pod)
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    service = one("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (picker,) = pods_of(service["spec"]["selector"])
    assert picker is router()["spec"]["template"]
    assert container_ports(picker)[port["targetPort"]] == router_toml()["epp_port"]
    (route,) = find("HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == pool["metadata"]["name"]
    (parent,) = route["spec"]["parentRefs"]
    gateway = one("Gateway", parent["name"])
    assert parent["sectionName"] in {lst["name"] for lst in gateway["spec"]["listeners"]}


def test_embedded_files_are_the_repositorys():
    conf = one("Secret", "nats-config")["stringData"]["nats.conf"]
    assert conf == (ROOT / "deploy" / "nats.conf").read_text()
    (nats,) = find("StatefulSet", "nats")
    args = nats["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["-c", "/etc/nats/nats.conf", "-js"]  # JetStream on
    dashboard = one("ConfigMap", "cache-router-dashboard")
    assert (
        dashboard["data"]["cache-router.json"]
        == (ROOT / "dashboards" / "cache-router.json").read_text()
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
