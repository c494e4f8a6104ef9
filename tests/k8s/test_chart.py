"""The Helm chart (k8s/charts/ddiloco), checked offline with real helm and no cluster.

- ``helm lint --strict`` with every values file;
- every document ``helm template`` renders validates against the Kubernetes 1.35 OpenAPI schemas
  in strict mode (kubernetes-validate: unknown fields fail), the Prometheus Operator objects
  against a small schema here;
- what matters about the objects: one synchronizer replica with a claim for its state, one learner
  Deployment per group, learners dialing the synchronizer Service's name and gRPC port, pod
  security, probes, the labels k8s/chaos selects on, Secrets mounted where the config says;
- the config.yaml in the ConfigMap is accepted by the services' own command-line parsers and
  config loaders (so a key the services refuse fails here) and holds no credentials;
- contradictory values stop the render with the chart's message; values of the wrong type or
  unknown keys are refused by values.schema.json;
- a synchronizer in shards: one pod per shard, each the shard its learners dial by name, no gRPC
  through a Service that spreads over shards; an upgrade that would change the shard count of a
  running release is refused (helm's lookup answered by a fake API server).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s.conftest import CHART, HELM_VERSION, ROOT, VALUES

K8S_VERSION = "1.35.0"
"""The Kubernetes version rendered for and validated against (kubectl in the pinned helm package is 1.35)."""
RELEASE = "train"
NAMESPACE = "ml"
FULLNAME = f"{RELEASE}-ddiloco"
SYNC_SERVICE = f"{FULLNAME}-synchronizer"
IMAGE_UID = 10001

VALUE_SETS: dict[str, tuple[str, ...]] = {
    "default": (),
    "secure": ("secure.yaml",),
    "monitoring": ("monitoring.yaml",),
    "streaming": ("streaming.yaml",),
    "sharded": ("sharded.yaml",),
}
"""Values files per case (tests/k8s/values): defaults; TLS, tokens and two learner groups, one on
GPUs; monitoring; a minimal streaming trial; a synchronizer in four shards."""
ONE_SHARD = [case for case in VALUE_SETS if case != "sharded"]
"""The cases with one synchronizer, which learners dial through its Service."""
SHARDS = 4
"""synchronizer.shards in sharded.yaml."""

Docs = list[dict[str, Any]]


class HelmFailed(Exception):
    """helm exited non-zero; the message is its stderr."""


def run_helm(helm: pathlib.Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.fixture(scope="session")
def render(helm: pathlib.Path, helm_env: dict[str, str]) -> Callable[..., Docs]:
    """Render the chart with values files (names in tests/k8s/values) and/or paths; cached."""
    cache: dict[tuple[str, ...], Docs] = {}

    def _render(*files: str | pathlib.Path, release: str = RELEASE, namespace: str = NAMESPACE) -> Docs:
        paths = tuple(str(f if isinstance(f, pathlib.Path) else VALUES / f) for f in files)
        key = (release, namespace, *paths)
        if key not in cache:
            args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", K8S_VERSION]
            for p in paths:
                args += ["--values", p]
            proc = run_helm(helm, helm_env, *args)
            if proc.returncode != 0:
                raise HelmFailed(proc.stderr)
            cache[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
        return cache[key]

    return _render


@pytest.fixture
def render_values(render: Callable[..., Docs], tmp_path: pathlib.Path) -> Callable[[dict[str, Any]], Docs]:
    """Render with values given as a dict (written to a file: lists replace, as in a values file)."""
    counter = iter(range(1000))

    def _render(values: dict[str, Any]) -> Docs:
        path = tmp_path / f"values-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump(values))
        return render(path)

    return _render


def by_kind(docs: Docs, kind: str) -> Docs:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in by_kind(docs, kind)]}"
    return found[0]


def workloads(docs: Docs) -> Docs:
    return [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def learner_deployments(docs: Docs) -> Docs:
    return [d for d in by_kind(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "learner"]


def synchronizer(docs: Docs) -> dict[str, Any]:
    return one(docs, "StatefulSet", SYNC_SERVICE)


def config_document(docs: Docs) -> dict[str, Any]:
    found = [cm for cm in by_kind(docs, "ConfigMap") if "config.yaml" in cm["data"]]
    assert len(found) == 1
    cm = found[0]
    assert set(cm["data"]) == {"config.yaml"}
    for w in workloads(docs):  # the file every pod reads at --config
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == cm["metadata"]["name"]
        mount = next(m for m in container(w)["volumeMounts"] if m["name"] == "config")
        assert (mount["mountPath"], mount["subPath"]) == (flag(container(w)["args"], "--config"), "config.yaml")
    doc = yaml.safe_load(cm["data"]["config.yaml"])
    assert isinstance(doc, dict)
    return doc


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def named_port(c: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert name in ports, f"container {c['name']} has no port named {name}: {ports}"
    return ports[name]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------
# helm lint and schema validation of every rendered document


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_helm_lint_strict(helm: pathlib.Path, helm_env: dict[str, str], case: str) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION]
    for f in VALUE_SETS[case]:
        args += ["--values", str(VALUES / f)]
    proc = run_helm(helm, helm_env, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_helm_is_the_pinned_one(helm: pathlib.Path, helm_env: dict[str, str]) -> None:
    proc = run_helm(helm, helm_env, "version", "--short")
    assert proc.returncode == 0, proc.stderr
    if os.environ.get("DDILOCO_HELM"):
        assert re.match(r"v[34]\.\d+\.\d+", proc.stdout), proc.stdout
    else:
        assert proc.stdout.startswith(HELM_VERSION + "+"), proc.stdout


_PROMETHEUS_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
        "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["matchLabels"],
    "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                   "additionalProperties": {"type": "string"}}},
}


def _monitor_schema(kind: str, endpoints: str) -> dict[str, Any]:
    """The part of the Prometheus Operator's monitoring.coreos.com/v1 CRD schema the chart uses."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints],
                "properties": {
                    "selector": _LABEL_SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"},
                                       "matchNames": {"type": "array", "items": {"type": "string"}}},
                    },
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    "targetLabels": {"type": "array", "items": {"type": "string"}},
                    "jobLabel": {"type": "string"},
                    endpoints: {"type": "array", "minItems": 1, "items": _PROMETHEUS_ENDPOINT},
                },
            },
        },
    }


CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _monitor_schema("ServiceMonitor", "endpoints"),
    ("monitoring.coreos.com/v1", "PodMonitor"): _monitor_schema("PodMonitor", "podMetricsEndpoints"),
}


def validate_document(doc: dict[str, Any], version: str = K8S_VERSION) -> None:
    """Strict validation against Kubernetes' own schemas, or ours for the operator's kinds."""
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        jsonschema.validate(doc, crd)
        return
    kubernetes_validate.validate(doc, version, strict=True)


EVERYTHING = {"everything": ("secure.yaml", "monitoring.yaml"),
              "everything sharded": ("secure.yaml", "monitoring.yaml", "sharded.yaml")}


@pytest.mark.parametrize("case", [*VALUE_SETS, *EVERYTHING])
def test_every_document_validates_strictly(render: Callable[..., Docs], case: str) -> None:
    files = EVERYTHING.get(case) or VALUE_SETS[case]
    docs = render(*files)
    assert docs
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            validate_document(doc)
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: no schema to check it against: {exc.message}")
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(str(p) for p in exc.absolute_path)}: {exc.message}")


def test_the_oldest_supported_kubernetes(render: Callable[..., Docs], helm: pathlib.Path,
                                        helm_env: dict[str, str]) -> None:
    """Chart.yaml's kubeVersion is the oldest release whose schemas take every object; helm refuses
    an older one."""
    minimum = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    m = re.fullmatch(r">=(\d+)\.(\d+)\.0-0", minimum)
    assert m, minimum
    major, minor = int(m.group(1)), int(m.group(2))
    for files in EVERYTHING.values():
        for doc in render(*files):
            validate_document(doc, f"{major}.{minor}.0")
    proc = run_helm(helm, helm_env, "template", RELEASE, str(CHART), "--kube-version", f"{major}.{minor - 1}.0")
    assert proc.returncode != 0
    assert "kubeVersion" in proc.stderr, proc.stderr


def test_strict_validation_catches_a_misspelled_field(render: Callable[..., Docs]) -> None:
    """The validator really is strict: a field Kubernetes does not know is an error, not ignored."""
    doc = json.loads(json.dumps(synchronizer(render())))
    container(doc)["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        validate_document(doc)


def test_default_render_needs_no_operator_crds(render: Callable[..., Docs]) -> None:
    kinds = {(d["apiVersion"], d["kind"]) for d in render()}
    assert not {k for k in kinds if k[0].startswith("monitoring.coreos.com")}
    assert not by_kind(render(), "NetworkPolicy")
    assert ("v1", "Secret") not in kinds


# ---------------------------------------------------------------------------------------------
# the objects


@pytest.mark.parametrize("case", ["default", "secure"])
def test_one_synchronizer_replica_with_a_claim_for_its_state(render: Callable[..., Docs], case: str) -> None:
    sts = synchronizer(render(*VALUE_SETS[case]))
    assert sts["spec"]["replicas"] == 1
    claims = sts["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["state"]
    assert claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = sts["spec"]["template"]["spec"]
    assert "state" not in {v["name"] for v in pod["volumes"]}, "the claim, not a pod volume, backs /state"
    mounts = {m["mountPath"]: m["name"] for m in container(sts)["volumeMounts"]}
    assert mounts["/state"] == "state"
    assert flag(container(sts)["args"], "--state-dir") == "/state"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    if case == "secure":
        assert claims[0]["spec"]["storageClassName"] == "fast-ssd"
        assert claims[0]["spec"]["resources"]["requests"]["storage"] == "50Gi"
    else:
        assert "storageClassName" not in claims[0]["spec"]
        assert claims[0]["spec"]["resources"]["requests"]["storage"] == "20Gi"


def test_without_persistence_the_state_is_an_empty_dir(render: Callable[..., Docs]) -> None:
    docs = render("streaming.yaml")
    sts = one(docs, "StatefulSet", "trial-synchronizer")
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert not by_kind(docs, "PodDisruptionBudget")


def test_storage_class_dash_means_no_class(render_values: Callable[[dict[str, Any]], Docs]) -> None:
    sts = synchronizer(render_values({"synchronizer": {"persistence": {"storageClass": "-"}}}))
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == ""


def test_one_learner_deployment_per_group(render: Callable[..., Docs]) -> None:
    default = learner_deployments(render())
    assert [(d["metadata"]["name"], d["spec"]["replicas"]) for d in default] == [(f"{FULLNAME}-learner-main", 2)]

    docs = render("secure.yaml")
    groups = {d["metadata"]["name"]: d for d in learner_deployments(docs)}
    assert {name: d["spec"]["replicas"] for name, d in groups.items()} == {
        f"{FULLNAME}-learner-cpu": 3, f"{FULLNAME}-learner-gpu": 2}
    cpu, gpu = groups[f"{FULLNAME}-learner-cpu"], groups[f"{FULLNAME}-learner-gpu"]
    gpu_pod = gpu["spec"]["template"]["spec"]
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(gpu)["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert gpu_pod["runtimeClassName"] == "nvidia"
    assert container(gpu)["image"] == "registry.example.com/ml/ddiloco-learner-cuda:0.1.0"
    assert container(gpu)["args"][-2:] == ["--threads", "8"]
    assert "nvidia.com/gpu" not in container(cpu)["resources"]["limits"]
    assert "nodeSelector" not in cpu["spec"]["template"]["spec"]
    assert container(cpu)["image"] == "registry.example.com/ml/ddiloco-learner:0.1.0"
    assert container(synchronizer(docs))["image"] == "registry.example.com/ml/ddiloco-synchronizer:0.1.0"
    for d in (cpu, gpu):
        assert d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert container(d)["imagePullPolicy"] == "Always"


def test_default_images_are_tagged_with_the_app_version(render: Callable[..., Docs]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    docs = render()
    assert container(synchronizer(docs))["image"] == f"ddiloco-synchronizer:{chart['appVersion']}"
    assert container(learner_deployments(docs)[0])["image"] == f"ddiloco-learner:{chart['appVersion']}"


@pytest.mark.parametrize("case", ONE_SHARD)
def test_learners_dial_the_synchronizer_service(render: Callable[..., Docs], case: str) -> None:
    docs = render(*VALUE_SETS[case])
    sts = next(iter(by_kind(docs, "StatefulSet")))
    services = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") != "None"
                and matches(s["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])]
    assert len(services) == 1
    svc = services[0]
    assert svc["metadata"]["name"].endswith("-synchronizer")
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    sync = container(sts)
    listen_port = int(flag(sync["args"], "--listen").rpartition(":")[2])
    assert flag(sync["args"], "--listen").startswith("0.0.0.0:")
    assert named_port(sync, grpc["targetPort"]) == listen_port
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in by_kind(docs, "Service")}
    for deployment in learner_deployments(docs):
        args = container(deployment)["args"]
        assert args[0] == "learner"
        assert flag(args, "--synchronizer") == f"{svc['metadata']['name']}:{grpc['port']}"


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_pod_security(render: Callable[..., Docs], case: str) -> None:
    for workload in workloads(render(*VALUE_SETS[case])):
        pod = workload["spec"]["template"]["spec"]
        where = workload["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, where
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == ctx["runAsGroup"] == ctx["fsGroup"] == IMAGE_UID, where
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        c = container(workload)
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
        assert volumes[tmp["name"]]["emptyDir"] == {}, "a writable /tmp on a read-only root"
        assert pod["terminationGracePeriodSeconds"] == 60
        assert c["resources"]["requests"]["memory"]
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o440, where
    for account in by_kind(render(*VALUE_SETS[case]), "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


def test_probes_use_grpc_health_and_tcp_with_tls(render: Callable[..., Docs]) -> None:
    plain = container(synchronizer(render()))
    port = named_port(plain, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert plain[probe]["grpc"] == {"port": port}, probe
    assert plain["startupProbe"]["periodSeconds"] * plain["startupProbe"]["failureThreshold"] >= 300
    tls = container(synchronizer(render("secure.yaml")))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in tls[probe], "the kubelet's gRPC probe cannot do TLS"
        assert tls[probe]["tcpSocket"] == {"port": "grpc"}
        named_port(tls, tls[probe]["tcpSocket"]["port"])
    for deployment in learner_deployments(render()):
        assert "livenessProbe" not in container(deployment)


def test_disruption_budget_holds_the_synchronizer(render: Callable[..., Docs]) -> None:
    docs = render()
    pdb = one(docs, "PodDisruptionBudget", SYNC_SERVICE)
    assert pdb["spec"]["maxUnavailable"] == 0
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert matches(selector, synchronizer(docs)["spec"]["template"]["metadata"]["labels"])
    for deployment in learner_deployments(docs):
        assert not matches(selector, deployment["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("case", ["default", "secure", "monitoring"])
def test_labels_the_chaos_experiments_select_on(render: Callable[..., Docs], case: str) -> None:
    docs = render(*VALUE_SETS[case])
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "ddiloco", doc["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
    sts = synchronizer(docs)
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/component"] == "synchronizer"
    assert sts["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "ddiloco", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "synchronizer"}
    for deployment in learner_deployments(docs):
        group = deployment["metadata"]["name"].removeprefix(f"{FULLNAME}-learner-")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "learner"
        assert labels["ddiloco.io/learner-group"] == group
        assert deployment["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "ddiloco", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "learner", "ddiloco.io/learner-group": group}
    # every Service selects the pods it names, and only those
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)}
    for svc in by_kind(docs, "Service"):
        selected = {name for name, labels in pods.items() if matches(svc["spec"]["selector"], labels)}
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        assert selected == {name for name, labels in pods.items()
                            if labels["app.kubernetes.io/component"] == component}, svc["metadata"]["name"]


def test_a_release_named_ddiloco_is_not_named_twice(render: Callable[..., Docs]) -> None:
    docs = render(release="ddiloco", namespace="ddiloco")
    one(docs, "StatefulSet", "ddiloco-synchronizer")
    one(docs, "Service", "ddiloco-synchronizer")
    assert [d["metadata"]["name"] for d in learner_deployments(docs)] == ["ddiloco-learner-main"]
    assert flag(container(learner_deployments(docs)[0])["args"], "--synchronizer") == "ddiloco-synchronizer:7000"


def _mappings(node: Any, wanted: Callable[[dict[str, Any]], bool]) -> Iterator[dict[str, Any]]:
    """Every mapping in ``node`` (nested at any depth) for which ``wanted`` holds."""
    if isinstance(node, dict):
        if wanted(node):
            yield node
        for value in node.values():
            yield from _mappings(value, wanted)
    elif isinstance(node, list):
        for value in node:
            yield from _mappings(value, wanted)


def _selectors(node: Any) -> Iterator[dict[str, Any]]:
    """Every Chaos Mesh pod selector (a mapping with labelSelectors) in an experiment, nested or not."""
    return _mappings(node, lambda m: isinstance(m.get("labelSelectors"), dict))


def _selectors_with_containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every part of an experiment that names containers next to its pod selector."""
    return _mappings(node, lambda m: "containerNames" in m and isinstance(m.get("selector"), dict))


POD_INDEX = "apps.kubernetes.io/pod-index"
"""The label the StatefulSet controller (Kubernetes 1.28+) puts on each of its pods: the ordinal."""


def pods(docs: Docs) -> list[tuple[str, dict[str, str], set[str]]]:
    """(name, labels, container names) of the pods the workloads make, labelled as their
    controllers label them: each pod of a StatefulSet with its name and ordinal (the shard, with a
    sharded synchronizer), a Deployment's pods as one, by their template."""
    made = []
    for w in workloads(docs):
        template = w["spec"]["template"]
        labels, names = template["metadata"]["labels"], {c["name"] for c in template["spec"]["containers"]}
        if w["kind"] == "StatefulSet":
            for i in range(w["spec"]["replicas"]):
                pod = f"{w['metadata']['name']}-{i}"
                made.append((pod, {**labels, "statefulset.kubernetes.io/pod-name": pod, POD_INDEX: str(i)}, names))
        else:
            made.append((w["metadata"]["name"], labels, names))
    return made


def test_the_chaos_experiments_select_pods_of_the_chart(render: Callable[..., Docs]) -> None:
    """Each experiment in k8s/chaos, as written (release and namespace "ddiloco", group "main"),
    selects pods this chart makes, and the containers it names exist in them. One that picks a
    synchronizer pod by its ordinal is a shard experiment: it selects exactly that shard of a
    sharded synchronizer."""
    experiments = sorted((ROOT / "k8s" / "chaos").glob("*.yaml"))
    assert experiments, "k8s/chaos holds no experiments"
    one_shard = pods(render(release="ddiloco", namespace="ddiloco"))
    sharded = pods(render("sharded.yaml", release="ddiloco", namespace="ddiloco"))
    checked = shard_experiments = 0
    for path in experiments:
        for experiment in yaml.safe_load_all(path.read_text()):
            spec = (experiment or {}).get("spec")
            for selector in _selectors(spec):
                assert selector.get("namespaces", ["ddiloco"]) == ["ddiloco"], path.name
                labels = selector["labelSelectors"]
                if POD_INDEX in labels:
                    selected = [name for name, pod_labels, _ in sharded if matches(labels, pod_labels)]
                    assert selected == [f"ddiloco-synchronizer-{labels[POD_INDEX]}"], f"{path.name}: {selected}"
                    shard_experiments += 1
                else:
                    for made in (one_shard, sharded):
                        assert [n for n, pod_labels, _ in made if matches(labels, pod_labels)], \
                            f"{path.name}: {labels} selects no pod of the chart"
                checked += 1
            for node in _selectors_with_containers(spec):
                for _, pod_labels, names in sharded:
                    if matches(node["selector"]["labelSelectors"], pod_labels):
                        assert set(node["containerNames"]) <= names, f"{path.name}: {node['containerNames']}"
    assert checked
    assert shard_experiments, "no experiment kills one shard"


def test_metrics_ports(render: Callable[..., Docs]) -> None:
    docs = render()
    config = config_document(docs)
    assert named_port(container(synchronizer(docs)), "metrics") == config["synchronizer"]["metrics_port"] == 9100
    for deployment in learner_deployments(docs):
        assert named_port(container(deployment), "metrics") == config["learner"]["metrics_port"] == 9101
    assert config["synchronizer"]["metrics_host"] == config["learner"]["metrics_host"] == "0.0.0.0"
    learners = one(docs, "Service", f"{FULLNAME}-learners")
    assert learners["spec"]["clusterIP"] == "None"
    assert learners["spec"]["ports"] == [{"name": "metrics", "port": 9101, "targetPort": "metrics", "protocol": "TCP"}]


def test_monitoring_objects_select_what_they_scrape(render: Callable[..., Docs]) -> None:
    docs = render("monitoring.yaml")
    monitor = one(docs, "ServiceMonitor", SYNC_SERVICE)
    svc = one(docs, "Service", SYNC_SERVICE)
    assert matches(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert not matches(monitor["spec"]["selector"]["matchLabels"],
                       one(docs, "Service", f"{FULLNAME}-learners")["metadata"]["labels"])
    assert {p["name"] for p in svc["spec"]["ports"]} >= {e["port"] for e in monitor["spec"]["endpoints"]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    pod_monitor = one(docs, "PodMonitor", f"{FULLNAME}-learners")
    for deployment in learner_deployments(docs):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert matches(pod_monitor["spec"]["selector"]["matchLabels"], labels)
        for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
            named_port(container(deployment), endpoint["port"])
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "9101"
    assert not matches(pod_monitor["spec"]["selector"]["matchLabels"],
                       synchronizer(docs)["spec"]["template"]["metadata"]["labels"])


def _metric_names_in_source() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "services").glob("*/ddiloco/*/metrics.py"):
        names |= set(re.findall(r'"(ddiloco_[a-z_]+)"', path.read_text()))
    return names


def test_dashboard(render: Callable[..., Docs]) -> None:
    docs = render("monitoring.yaml")
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(cm["data"]["ddiloco.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "ddiloco.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert {"Goodput", "Merges per second", "Quorum size", "Staleness", "Bytes per second", "Live learners",
            "Tokens per second", "Training loss"} <= titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    known = _metric_names_in_source()
    assert "ddiloco_learner_blocked_seconds_total" in known  # the scan finds the services' metrics
    queried = set()
    for panel in panels:
        for target in panel["targets"]:
            for metric in re.findall(r"\b(ddiloco_[a-z_]+?)(?:_bucket|_sum|_count)?\{", target["expr"]):
                assert metric in known, f"panel {panel['title']!r} queries {metric}, which no service exports"
                queried.add(metric)
    assert {"ddiloco_learner_blocked_seconds_total", "ddiloco_sync_merges_total", "ddiloco_sync_quorum_size",
            "ddiloco_sync_staleness_versions", "ddiloco_sync_received_bytes_total", "ddiloco_sync_live_learners",
            "ddiloco_learner_tokens_total", "ddiloco_learner_train_loss"} <= queried
    assert not by_kind(render(), "ConfigMap")[1:], "only the config file without monitoring.dashboard"


def test_network_policies(render: Callable[..., Docs]) -> None:
    docs = render("secure.yaml")
    sync_policy = one(docs, "NetworkPolicy", SYNC_SERVICE)
    sync_pod = synchronizer(docs)["spec"]["template"]["metadata"]["labels"]
    assert matches(sync_policy["spec"]["podSelector"]["matchLabels"], sync_pod)
    grpc_rule, metrics_rule = sync_policy["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    learner_peer = grpc_rule["from"][0]["podSelector"]["matchLabels"]
    for deployment in learner_deployments(docs):
        assert matches(learner_peer, deployment["spec"]["template"]["metadata"]["labels"])
    assert not matches(learner_peer, sync_pod)
    assert grpc_rule["from"][1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ml-operators"}
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


# ---------------------------------------------------------------------------------------------
# the sharded synchronizer (synchronizer.shards)


def headless_service(docs: Docs) -> dict[str, Any]:
    """The synchronizer StatefulSet's governing Service."""
    sts = next(iter(by_kind(docs, "StatefulSet")))
    return one(docs, "Service", sts["spec"]["serviceName"])


def test_sharded_synchronizer_runs_one_pod_per_shard(render: Callable[..., Docs]) -> None:
    docs = render("sharded.yaml")
    sts = synchronizer(docs)
    assert sts["spec"]["replicas"] == SHARDS
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "a shard waits for no other shard"
    args = container(sts)["args"]  # the one template of every pod: each takes its shard from its name
    assert flag(args, "--shard") == f"ordinal/{SHARDS}"
    assert flag(args, "--state-dir") == "/state"
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["state"], \
        "a claim per pod: state-<pod>, each shard's own state"
    assert "state" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}


def test_each_pod_is_the_shard_its_learners_dial(render: Callable[..., Docs]) -> None:
    """Shard s, as the pod <sts>-s works it out from its host name, is the s-th address the learners
    expand from their pattern: the pod's DNS name on the headless Service and its gRPC port."""
    from ddiloco.protocol.shards import parse_shard, synchronizer_targets

    docs = render("sharded.yaml")
    sts = synchronizer(docs)
    headless = headless_service(docs)
    assert headless["metadata"]["name"] == f"{SYNC_SERVICE}-headless"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    grpc = next(p for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert named_port(container(sts), grpc["targetPort"]) == grpc["port"]
    listen_port = int(flag(container(sts)["args"], "--listen").rpartition(":")[2])
    assert listen_port == grpc["port"]

    pod_names = [name for name, _, _ in pods(docs) if name.startswith(f"{SYNC_SERVICE}-")]
    assert pod_names == [f"{SYNC_SERVICE}-{s}" for s in range(SHARDS)]
    expected = [f"{name}.{headless['metadata']['name']}.{NAMESPACE}.svc:{grpc['port']}" for name in pod_names]
    shard_spec = flag(container(sts)["args"], "--shard")
    for s, name in enumerate(pod_names):
        assert parse_shard(shard_spec, hostname=name) == (s, SHARDS)
    learners = learner_deployments(docs)
    assert learners
    for deployment in learners:
        args = container(deployment)["args"]
        pattern = flag(args, "--synchronizer")
        assert pattern == f"{SYNC_SERVICE}-{{shard}}.{SYNC_SERVICE}-headless.{NAMESPACE}.svc:7000"
        assert flag(args, "--synchronizer-shards") == str(SHARDS)
        assert synchronizer_targets(pattern, int(flag(args, "--synchronizer-shards"))) == expected


def test_sharded_service_carries_no_grpc(render: Callable[..., Docs]) -> None:
    """A ClusterIP over the shards would send a learner's stream to any shard: the regular Service
    keeps only the metrics port, which the ServiceMonitor scrapes on every shard's pod."""
    docs = render("sharded.yaml")
    svc = one(docs, "Service", SYNC_SERVICE)
    assert svc["spec"].get("clusterIP") != "None"
    assert [p["name"] for p in svc["spec"]["ports"]] == ["metrics"]
    sts_labels = synchronizer(docs)["spec"]["template"]["metadata"]["labels"]
    assert matches(svc["spec"]["selector"], sts_labels), "every shard pod is behind it, for scraping"
    grpc_services = [s["metadata"]["name"] for s in by_kind(docs, "Service")
                     if any(p["name"] == "grpc" for p in s["spec"]["ports"])]
    assert grpc_services == [f"{SYNC_SERVICE}-headless"]
    monitor = one(docs, "ServiceMonitor", SYNC_SERVICE)
    assert matches(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    named_port(container(synchronizer(docs)), "metrics")


def test_sharded_budget_and_policies_cover_every_shard(render: Callable[..., Docs]) -> None:
    docs = render("sharded.yaml")
    shard_pods = [labels for name, labels, _ in pods(docs) if name.startswith(f"{SYNC_SERVICE}-")]
    assert len(shard_pods) == SHARDS
    pdb = one(docs, "PodDisruptionBudget", SYNC_SERVICE)
    assert pdb["spec"]["maxUnavailable"] == 0, "no shard is spare: each holds its own fragments"
    policy = one(docs, "NetworkPolicy", SYNC_SERVICE)
    for labels in shard_pods:
        assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
        assert matches(policy["spec"]["podSelector"]["matchLabels"], labels)
    learner_peer = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for deployment in learner_deployments(docs):
        assert matches(learner_peer, deployment["spec"]["template"]["metadata"]["labels"])


def test_one_shard_renders_as_without_the_value(render: Callable[..., Docs],
                                               render_values: Callable[[dict[str, Any]], Docs]) -> None:
    """shards: 1 is the chart as it was: one pod started in order, no shard flags, learners on the
    Service's name."""
    docs = render_values({"synchronizer": {"shards": 1}})
    assert docs == render()
    sts = synchronizer(docs)
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["podManagementPolicy"] == "OrderedReady"
    assert sts["spec"]["serviceName"] == f"{SYNC_SERVICE}-headless"
    assert "--shard" not in container(sts)["args"]
    for deployment in learner_deployments(docs):
        args = container(deployment)["args"]
        assert flag(args, "--synchronizer") == f"{SYNC_SERVICE}:7000"
        assert "--synchronizer-shards" not in args
    assert [p["name"] for p in one(docs, "Service", SYNC_SERVICE)["spec"]["ports"]] == ["grpc", "metrics"]


def _cli_knows(main: Callable[[list[str]], int], option: str, capsys: pytest.CaptureFixture[str]) -> bool:
    with pytest.raises(SystemExit):
        main(["--help"])
    return option in capsys.readouterr().out


def test_sharded_command_lines_are_accepted_by_the_services(render: Callable[..., Docs],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The services' own parsers take the sharded command lines (skipped while this checkout's
    services do not have the shard options yet)."""
    from ddiloco.learner import main as learner_main
    from ddiloco.synchronizer import main as synchronizer_main

    docs = render("sharded.yaml")
    missing = [f"{where} {option}" for main, where, option in (
        (synchronizer_main.main, "ddiloco synchronizer", "--shard"),
        (learner_main.main, "ddiloco learner", "--synchronizer-shards")) if not _cli_knows(main, option, capsys)]
    if missing:
        pytest.skip(f"no {', '.join(missing)} in this checkout's services")
    sync_argv = container(synchronizer(docs))["args"]
    assert sync_argv[0] == "synchronizer"
    args = _real_cli_args(synchronizer_main.main, sync_argv[1:], monkeypatch)
    assert args.config == "/etc/ddiloco/config.yaml"
    for deployment in learner_deployments(docs):
        argv = container(deployment)["args"]
        args = _real_cli_args(learner_main.main, argv[1:], monkeypatch)
        assert args.synchronizer == flag(argv, "--synchronizer")


def test_notes_show_the_fleet_view_of_every_shard(helm: pathlib.Path, helm_env: dict[str, str]) -> None:
    from ddiloco.protocol.shards import synchronizer_targets

    proc = run_helm(helm, helm_env, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                    "--values", str(VALUES / "sharded.yaml"))
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout[proc.stdout.index("NOTES:"):]
    assert f"in {SHARDS} shards" in notes
    assert f"never `kubectl scale statefulset/{SYNC_SERVICE}`" in notes
    assert (f"for s in $(seq 0 {SHARDS - 1}); do kubectl --namespace {NAMESPACE} port-forward "
            f"pod/{SYNC_SERVICE}-$s $((7000 + s)):7000 & done") in notes
    m = re.search(r"ddiloco status --synchronizer (\S+) --shards (\d+)", notes)
    assert m, notes
    assert synchronizer_targets(m.group(1), int(m.group(2))) == [f"127.0.0.1:{7000 + s}" for s in range(SHARDS)]
    assert f"port-forward svc/{SYNC_SERVICE} " not in notes, "the Service has no gRPC port with shards"


# the shard count is fixed for a fleet's life: helm upgrade looks up the running StatefulSet


def _running_synchronizer(shards: int | None, replicas: int) -> dict[str, Any]:
    """The synchronizer StatefulSet as the API server returns it: deployed with ``shards`` (None: a
    release of the chart from before shards, without the flag), scaled to ``replicas``."""
    args = ["synchronizer", "--listen", "0.0.0.0:7000", "--state-dir", "/state", "--config",
            "/etc/ddiloco/config.yaml"]
    if shards is not None:
        args += ["--shard", f"ordinal/{shards}"]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": SYNC_SERVICE, "namespace": NAMESPACE,  # a release's object, as helm marks it
                         "labels": {"app.kubernetes.io/managed-by": "Helm"},
                         "annotations": {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}},
            "spec": {"replicas": replicas, "serviceName": f"{SYNC_SERVICE}-headless",
                     "template": {"spec": {"containers": [{"name": "synchronizer", "image": "x", "args": args}]}}},
            "status": {"replicas": replicas}}


UPGRADES: dict[str, tuple[tuple[int | None, int] | None, int, str | None]] = {
    # running (shards, replicas) or None, synchronizer.shards wanted, the refusal (None: renders)
    "first install": (None, SHARDS, None),
    "same shards": ((SHARDS, SHARDS), SHARDS, None),
    "one shard, from before the value": ((None, 1), 1, None),
    "one shard to four": ((None, 1), SHARDS,
                          f"synchronizer.shards is {SHARDS}, but the running StatefulSet {SYNC_SERVICE} was "
                          "deployed with 1 shard(s)"),
    "four shards to two": ((SHARDS, SHARDS), 2,
                           f"synchronizer.shards is 2, but the running StatefulSet {SYNC_SERVICE} was "
                           f"deployed with {SHARDS} shard(s)"),
    "four shards to one": ((SHARDS, SHARDS), 1, "the shard count is fixed for a fleet's life"),
    # `kubectl scale` to 2: the pods still run ordinal/4; 2 shards would be read on 4-shard state
    "scaled by hand, then shards set to the replicas": ((SHARDS, 2), 2,
                                                        f"was deployed with {SHARDS} shard(s)"),
    # the same, and the upgrade keeps S: it brings the missing shards back
    "scaled by hand, shards kept": ((SHARDS, 2), SHARDS, None),
}


@pytest.mark.parametrize("case", list(UPGRADES))
def test_an_upgrade_keeps_the_shard_count(fake_cluster: Any, helm: pathlib.Path, case: str) -> None:
    running, shards, refusal = UPGRADES[case]
    if running is not None:
        fake_cluster.statefulsets[NAMESPACE, SYNC_SERVICE] = _running_synchronizer(*running)
    proc = run_helm(helm, fake_cluster.env, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--dry-run=server", "--disable-openapi-validation", "--set", f"synchronizer.shards={shards}",
                    "--set", "config.protocol.num_fragments=12")
    assert f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{SYNC_SERVICE}" in fake_cluster.requests, \
        "helm did not look the StatefulSet up"
    if refusal is None:
        assert proc.returncode == 0, proc.stderr
        sts = synchronizer([d for d in yaml.safe_load_all(proc.stdout) if d])
        assert sts["spec"]["replicas"] == shards
    else:
        assert proc.returncode != 0, f"helm rendered {case!r}"
        assert refusal in proc.stderr, proc.stderr
        assert "fixed for a fleet's life" in proc.stderr


# ---------------------------------------------------------------------------------------------
# the config file and the Secrets


_SECRET_KEY = re.compile(r"token|secret|password|passwd|private|credential|key", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"-----BEGIN|^[A-Za-z0-9+/=_-]{32,}$", re.MULTILINE)


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}" if path else str(k), v
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for n, v in enumerate(value):
            yield from _walk(v, f"{path}[{n}]")


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_config_maps_hold_no_credentials(render: Callable[..., Docs], case: str) -> None:
    """Tokens and keys come from Secrets: a ConfigMap only ever names the files they are mounted at."""
    docs = render(*VALUE_SETS[case])
    for cm in by_kind(docs, "ConfigMap"):
        for name, text in cm["data"].items():
            assert name.endswith(".json") or not _SECRET_VALUE.search(text), f"{cm['metadata']['name']}/{name}"
            assert "BEGIN" not in text
        if "config.yaml" not in cm["data"]:
            continue
        for path, value in _walk(yaml.safe_load(cm["data"]["config.yaml"])):
            key = path.rsplit(".", 1)[-1]
            if _SECRET_KEY.search(key):
                assert key.endswith("_file") or key.startswith("tls_"), f"config.yaml: {path} looks like a credential"
                assert isinstance(value, str) and value.startswith("/etc/ddiloco/"), f"{path}: {value!r}"
            if isinstance(value, str):
                assert not _SECRET_VALUE.search(value), f"config.yaml: {path} holds a token-looking value"
    assert not by_kind(docs, "Secret"), "the chart never writes Secrets (their contents would sit in the release)"


def _mounted_secret_file(workload: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in the workload's container."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container(workload)["volumeMounts"]:
        base = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(base) and "subPath" not in mount:
            secret = volumes[mount["name"]].get("secret")
            assert secret is not None, f"{path} is in volume {mount['name']}, not a Secret"
            rel = path[len(base):]
            keys = {item["path"]: item["key"] for item in secret["items"]}
            assert rel in keys, f"{path}: Secret {secret['secretName']} projects only {sorted(keys)}"
            return secret["secretName"], keys[rel]
    raise AssertionError(f"{workload['metadata']['name']}: nothing is mounted at {path}")


def test_credentials_are_mounted_where_the_config_says(render: Callable[..., Docs]) -> None:
    docs = render("secure.yaml")
    config = config_document(docs)
    sync = synchronizer(docs)
    s = config["synchronizer"]
    assert s["identity_binding"] == "prefix"
    assert _mounted_secret_file(sync, s["auth_tokens_file"]) == ("ddiloco-tokens", "tokens.yaml")
    assert _mounted_secret_file(sync, s["tls_cert"]) == ("ddiloco-tls", "tls.crt")
    assert _mounted_secret_file(sync, s["tls_key"]) == ("ddiloco-tls", "tls.key")
    assert _mounted_secret_file(sync, s["tls_client_ca"]) == ("ddiloco-tls", "ca.crt")
    mounts = {m["name"]: m for m in container(sync)["volumeMounts"]}
    assert "subPath" not in mounts["tokens"], "a subPath mount would never see a rotated Secret"
    groups = {d["metadata"]["name"].removeprefix(f"{FULLNAME}-learner-"): d for d in learner_deployments(docs)}
    learner = config["learner"]
    expected = {"cpu": ("ddiloco-learner-token", "ddiloco-learner-tls"),
                "gpu": ("ddiloco-learner-gpu-token", "ddiloco-learner-gpu-tls")}
    for group, (token_secret, tls_secret) in expected.items():
        d = groups[group]
        assert _mounted_secret_file(d, learner["token_file"]) == (token_secret, "token")
        assert _mounted_secret_file(d, learner["tls_ca"]) == (tls_secret, "ca.crt")
        assert _mounted_secret_file(d, learner["tls_cert"]) == (tls_secret, "tls.crt")
        assert _mounted_secret_file(d, learner["tls_key"]) == (tls_secret, "tls.key")
        secrets = {v["secret"]["secretName"] for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        assert "ddiloco-tokens" not in secrets and "ddiloco-tls" not in secrets, "learners never see the synchronizer's"


def test_tls_without_client_certificates_gives_learners_only_the_ca(
        render_values: Callable[[dict[str, Any]], Docs]) -> None:
    docs = render_values({"tls": {"enabled": True, "existingSecret": "sync-tls"}})
    config = config_document(docs)
    assert "tls_client_ca" not in config["synchronizer"]
    assert {"tls_cert", "tls_key", "token_file"}.isdisjoint(config["learner"])
    for d in learner_deployments(docs):
        assert _mounted_secret_file(d, config["learner"]["tls_ca"]) == ("sync-tls", "ca.crt")
        tls = next(v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert [i["key"] for i in tls["secret"]["items"]] == ["ca.crt"], "the server's key never reaches a learner"
    assert "identity_binding" not in config["synchronizer"]


def _real_cli_args(main: Callable[[list[str]], int], argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the service's own command-line parser makes of ``argv`` (stopped right after parsing)."""
    parsed: dict[str, argparse.Namespace] = {}

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def spy(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        parsed["args"] = original(self, args, namespace)
        raise Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", spy)
        with pytest.raises(Parsed):
            main(argv)
    return parsed["args"]


def _relocate(doc: Any, root: pathlib.Path) -> Any:
    """The document with every /etc/ddiloco/... path moved under ``root``."""
    if isinstance(doc, dict):
        return {k: _relocate(v, root) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_relocate(v, root) for v in doc]
    if isinstance(doc, str) and doc.startswith("/etc/ddiloco/"):
        return str(root / doc.lstrip("/"))
    return doc


@pytest.mark.parametrize("case", ONE_SHARD)
def test_config_is_accepted_by_the_services(render: Callable[..., Docs], case: str, tmp_path: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The services' own parsers and loaders take the rendered command lines and config file: a key
    they refuse, a mode that contradicts its settings or an unknown flag fails here, not in a pod."""
    from ddiloco.learner import main as learner_main
    from ddiloco.learner.config import load_learner_config
    from ddiloco.synchronizer import main as synchronizer_main

    docs = render(*VALUE_SETS[case])
    config = config_document(docs)
    # the pods' files, under tmp_path: the config file and what the Secrets would hold
    doc = _relocate(config, tmp_path)
    for path in [v for _, v in _walk(doc) if isinstance(v, str) and v.startswith(str(tmp_path))]:
        file = pathlib.Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("a-learner-token-of-enough-length\n" if file.name == "token" else "placeholder\n")
    config_path = tmp_path / "etc" / "ddiloco" / "config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(doc))

    sts = next(iter(by_kind(docs, "StatefulSet")))
    sync_argv = container(sts)["args"]
    assert sync_argv[0] == "synchronizer"
    args = _real_cli_args(synchronizer_main.main, sync_argv[1:], monkeypatch)
    assert args.config == "/etc/ddiloco/config.yaml"
    args.config = str(config_path)
    sync_cfg = synchronizer_main.config_from_args(args)
    assert sync_cfg.listen == f"0.0.0.0:{named_port(container(sts), 'grpc')}"
    assert sync_cfg.state_dir == "/state"
    assert sync_cfg.metrics_port == named_port(container(sts), "metrics")
    assert sync_cfg.metrics_host == "0.0.0.0"
    assert sync_cfg.protocol.mode == (config.get("protocol") or {}).get("mode", "decoupled")

    for deployment in learner_deployments(docs):
        argv = container(deployment)["args"]
        assert argv[0] == "learner"
        args = _real_cli_args(learner_main.main, argv[1:], monkeypatch)
        assert args.config == "/etc/ddiloco/config.yaml"
        cfg = load_learner_config(str(config_path), synchronizer=args.synchronizer, learner_id=args.learner_id,
                                  shard_index=args.shard_index, num_shards=args.num_shards,
                                  event_log=args.event_log, speed=args.speed, token_file=args.token_file)
        assert cfg.synchronizer == flag(argv, "--synchronizer")
        assert cfg.learner_id == "", "the learner id is the pod name ($HOSTNAME)"
        assert cfg.metrics_port == named_port(container(deployment), "metrics")
        assert cfg.metrics_host == "0.0.0.0"
        assert cfg.protocol == sync_cfg.protocol, "learners and the synchronizer agree on the protocol"
        if case == "secure":
            assert cfg.credentials.token == "a-learner-token-of-enough-length"
            assert cfg.tls_ca and cfg.tls_cert and cfg.tls_key
    if case == "secure":
        assert sync_cfg.identity_binding == "prefix"
        assert sync_cfg.auth_tokens_file and sync_cfg.tls_client_ca
        assert sync_cfg.policy.quorum == 3
    if case == "streaming":
        assert sync_cfg.policy.quorum == 0


def test_free_form_config_reaches_the_file(render_values: Callable[[dict[str, Any]], Docs]) -> None:
    """Any key the services take passes through, numbers keep their types (an int the size of a
    transfer limit stays an int for the strict loaders), and the chart's keys are added."""
    from ddiloco.learner.config import learner_config
    from ddiloco.synchronizer.config import synchronizer_config

    values = {"config": {"synchronizer": {"limits": {"hello_burst": 256}, "outer_lr": 0.5},
                         "model": {"n_layer": 6}, "data": {"batch_size": 32}}}
    values["config"]["synchronizer"]["limits"]["max_transfer_bytes"] = 8 * 1024**3  # beyond 32 bits
    values["config"]["train"] = {"lr": 1.0e-3, "betas": [0.9, 0.99]}
    config = config_document(render_values(values))
    sync = synchronizer_config(config, listen="0.0.0.0:7000", state_dir="/state")
    assert sync.limits.max_transfer_bytes == 8 * 1024**3 and sync.outer_lr == 0.5
    learner = learner_config(config, synchronizer=f"{SYNC_SERVICE}:7000")
    assert learner.train.lr == 1.0e-3 and learner.train.betas == (0.9, 0.99) and learner.model.n_layer == 6
    assert config["synchronizer"]["limits"] == {"hello_burst": 256, "max_transfer_bytes": 8 * 1024**3}
    assert config["synchronizer"]["outer_lr"] == 0.5
    assert config["synchronizer"]["metrics_port"] == 9100
    assert config["model"] == {"n_layer": 6}
    assert config["data"] == {"batch_size": 32}


def test_a_config_change_restarts_the_pods(render: Callable[..., Docs],
                                           render_values: Callable[[dict[str, Any]], Docs]) -> None:
    def checksums(docs: Docs) -> set[str]:
        return {w["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for w in workloads(docs)}

    before = checksums(render())
    after = checksums(render_values({"config": {"train": {"steps": 1000}}}))
    assert len(before) == len(after) == 1
    assert before != after


def test_notes_print_the_next_commands(helm: pathlib.Path, helm_env: dict[str, str]) -> None:
    """What `helm install` prints (a client-side dry run: no cluster)."""
    proc = run_helm(helm, helm_env, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                    "--values", str(VALUES / "secure.yaml"))
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout[proc.stdout.index("NOTES:"):]
    for group in ("cpu", "gpu"):
        assert f"kubectl --namespace {NAMESPACE} scale deployment/{FULLNAME}-learner-{group} --replicas" in notes
    assert f"kubectl --namespace {NAMESPACE} port-forward svc/{SYNC_SERVICE} 7000:7000" in notes
    assert "ddiloco status --synchronizer 127.0.0.1:7000 --tls-ca" in notes
    assert "k8s/chaos/" in notes
    assert f"{FULLNAME}-learner-gpu" in notes[notes.index("Learner identities"):]


# ---------------------------------------------------------------------------------------------
# refused values


def _group(name: str = "main", replicas: int = 2, **extra: Any) -> dict[str, Any]:
    return {"name": name, "replicas": replicas, **extra}


CONTRADICTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "two synchronizers": ({"synchronizer": {"replicas": 2}},
                          "synchronizer.replicas must be 1, got 2"),
    "tls without its secret": ({"tls": {"enabled": True}},
                               "tls.enabled needs tls.existingSecret"),
    "mutual tls without tls": ({"tls": {"mutual": True}},
                               "tls.mutual needs tls.enabled"),
    "negative replicas": ({"learners": {"groups": [_group(replicas=-1)]}},
                          "learners.groups[0] (main): replicas must be >= 0, got -1"),
    "duplicate group names": ({"learners": {"groups": [_group("a"), _group("b"), _group("a")]}},
                              'learners.groups: the name "a" is used twice'),
    "quorum above the learners": ({"config": {"synchronizer": {"policy": {"quorum": 5}}},
                                   "learners": {"groups": [_group(replicas=2), _group("b", replicas=2)]}},
                                  "config.synchronizer.policy.quorum is 5 but learners.groups have 4 replicas in all"),
    "prefix binding without credentials": ({"auth": {"identityBinding": "prefix"}},
                                           "auth.identityBinding prefix needs credentials to bind"),
    "exact binding with tokens": ({"auth": {"identityBinding": "exact", "tokens": {"existingSecret": "t"},
                                            "learners": {"existingSecret": "lt"}}},
                                  "auth.identityBinding exact cannot work with learner Deployments"),
    "synchronizer metrics on the grpc port": ({"synchronizer": {"metricsPort": 7000}},
                                              "synchronizer.metricsPort 7000 collides with the gRPC port"),
    "learner metrics on the grpc port": ({"learners": {"metricsPort": 7000}},
                                         "learners.metricsPort 7000 collides with the synchronizer's gRPC port"),
    "tokens but a learner without one": ({"auth": {"tokens": {"existingSecret": "t"}},
                                          "learners": {"groups": [_group(tokenSecret="x"), _group("b")]}},
                                         "learners.groups[1] (b) has no token"),
    "learner token without synchronizer tokens": ({"auth": {"learners": {"existingSecret": "lt"}}},
                                                  "auth.learners.existingSecret is set but auth.tokens.existingSecret is not"),
    "mutual tls without client certificates": ({"tls": {"enabled": True, "existingSecret": "s", "mutual": True}},
                                               "learners.groups[0] (main) has no client certificate"),
    "inline tokens in the config": ({"config": {"synchronizer": {"auth_tokens": {"a": "0123456789abcdef0123"}}}},
                                    "config.synchronizer.auth_tokens would put tokens in a ConfigMap"),
    "inline learner token": ({"config": {"learner": {"token": "0123456789abcdef0123"}}},
                             "config.learner.token would put a token in a ConfigMap"),
    "a key the chart owns": ({"config": {"learner": {"metrics_port": 9999}}},
                             "config.learner.metrics_port is set by the chart; set it through "
                             "synchronizer.metricsPort / learners.metricsPort"),
    "the state dir in the config": ({"config": {"synchronizer": {"state_dir": "/x"}}},
                                    "config.synchronizer.state_dir is set by the chart"),
    "a group name too long for pod names": ({"learners": {"groups": [_group("group-with-a-long-name-xy")]}},
                                            "at most 46 keep its pod names"),
    "more shards than fragments": ({"synchronizer": {"shards": 8}, "config": {"protocol": {"num_fragments": 6}}},
                                   "synchronizer.shards is 8 but the model has only 6 fragment(s) "
                                   "(config.protocol.num_fragments): shard s owns the fragments p with p % S == s, "
                                   "so 2 shard(s) would own nothing"),
    "shards in diloco mode": ({"synchronizer": {"shards": 2}, "config": {"protocol": {"mode": "diloco"}}},
                              "(config.protocol.mode diloco: one fragment)"),
    "the learners' shard count in the config": ({"config": {"learner": {"synchronizer_shards": 4}}},
                                                "config.learner.synchronizer_shards is set by the chart; "
                                                "set it through synchronizer.shards"),
    "a shard index in the config": ({"config": {"synchronizer": {"shard_index": 1}}},
                                    "config.synchronizer.shard_index is set by the chart"),
    "a shard count in the config": ({"config": {"synchronizer": {"shard_count": 4}}},
                                    "config.synchronizer.shard_count is set by the chart"),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_contradictory_values_fail_with_a_readable_message(
        render_values: Callable[[dict[str, Any]], Docs], case: str) -> None:
    values, message = CONTRADICTIONS[case]
    with pytest.raises(HelmFailed) as failed:
        render_values(values)
    assert message in str(failed.value), str(failed.value)


SCHEMA_VIOLATIONS: dict[str, tuple[dict[str, Any], str]] = {
    "replicas as text": ({"learners": {"groups": [_group(replicas="two")]}},  # type: ignore[arg-type]
                         "/learners/groups/0/replicas"),
    "a misspelled key": ({"synchronizer": {"replica": 1}}, "'replica' not allowed"),
    "an unknown config section": ({"config": {"synchroniser": {}}}, "'synchroniser' not allowed"),
    "a group name with capitals": ({"learners": {"groups": [_group("Main")]}}, "/learners/groups/0/name"),
    "a port out of range": ({"synchronizer": {"port": 70000}}, "/synchronizer/port"),
    "an unknown identity binding": ({"auth": {"identityBinding": "loose"}}, "/auth/identityBinding"),
    "a group without replicas": ({"learners": {"groups": [{"name": "x"}]}}, "replicas"),
    "zero shards": ({"synchronizer": {"shards": 0}}, "/synchronizer/shards"),
    "negative shards": ({"synchronizer": {"shards": -2}}, "/synchronizer/shards"),
    "fractional shards": ({"synchronizer": {"shards": 2.5}}, "/synchronizer/shards"),
    "shards as text": ({"synchronizer": {"shards": "4"}}, "/synchronizer/shards"),
    "shards beyond the maximum": ({"synchronizer": {"shards": 65}}, "/synchronizer/shards"),
}


@pytest.mark.parametrize("case", list(SCHEMA_VIOLATIONS))
def test_schema_refuses_values(render_values: Callable[[dict[str, Any]], Docs], case: str) -> None:
    values, where = SCHEMA_VIOLATIONS[case]
    with pytest.raises(HelmFailed) as failed:
        render_values(values)
    assert "values don't meet the specifications of the schema" in str(failed.value), str(failed.value)
    assert where in str(failed.value), str(failed.value)


def test_quorum_within_the_learners_and_streaming_quorum_pass(render_values: Callable[[dict[str, Any]], Docs]) -> None:
    render_values({"config": {"synchronizer": {"policy": {"quorum": 2}}}})
    render_values({"config": {"protocol": {"mode": "streaming"}, "synchronizer": {"policy": {"quorum": 0}}}})
    render_values({"learners": {"groups": [_group(replicas=0)]}})  # a synchronizer first, learners later
    render_values({"synchronizer": {"shards": 6}, "config": {"protocol": {"num_fragments": 6}}})  # one each
    render_values({"synchronizer": {"shards": 64}})  # the default fragment count is the services' to check


def test_every_value_is_documented_and_typed() -> None:
    """Every value in values.yaml has a comment: its own, or a "-- " comment of an enclosing key
    (a pass-through object such as resources or podSecurityContext); values.schema.json types
    every one of them."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented with a "-- " comment) of the enclosing keys
    for n, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w./-]*):(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        comment = []  # the comment block right above the key
        k = n - 1
        while k >= 0 and lines[k].strip().startswith("#"):
            comment.insert(0, lines[k].strip())
            k -= 1
        inherited = any(dashed for _, dashed in stack)
        is_leaf = m.group(3).strip() != ""
        if is_leaf and not (comment or inherited):
            undocumented.append(line.strip())
        stack.append((indent, (bool(comment) and comment[0].startswith("# --")) or inherited))
    assert not undocumented, f"values.yaml values without a comment: {undocumented}"

    def typed(value: Any, node: dict[str, Any], path: str) -> None:
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        assert "type" in node or "const" in node, f"{path}: no type in values.schema.json"
        if isinstance(value, dict) and node.get("properties") and node.get("additionalProperties") is False:
            for k, v in value.items():
                assert k in node["properties"], f"{path}.{k}: not in values.schema.json"
                typed(v, node["properties"][k], f"{path}.{k}")

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    typed(values, schema, "values")
