"""The Chaos Mesh experiments under k8s/chaos, checked without a cluster.

Every YAML document there must validate against the schema the project keeps
(k8s/chaos/schema/), end by itself (a duration, or a deadline inside a Workflow), select only this
project's pods by the Helm chart's labels in namespace ``ddiloco``, and appear in the runbook
(k8s/chaos/README.md), whose mapping table must classify every event kind of the local chaos
driver (``ddiloco.lab.chaos``) and whose example events must be valid events for that driver.
The schema itself must reject the usual mistakes: a misspelt field, an unknown action, a missing
or malformed duration, a mode that needs a value without one.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ddiloco.core.config import build
from ddiloco.lab.chaos import KINDS, NET_FAULTS, FaultEvent

ROOT = Path(__file__).resolve().parents[2]
CHAOS_DIR = ROOT / "k8s" / "chaos"
SCHEMA_PATH = CHAOS_DIR / "schema" / "chaos-mesh-v1alpha1.schema.json"
README_PATH = CHAOS_DIR / "README.md"

NAMESPACE = "ddiloco"
CHART_LABELS = {"app.kubernetes.io/name": "ddiloco", "app.kubernetes.io/instance": "ddiloco"}
COMPONENT_LABEL = "app.kubernetes.io/component"
LEARNER_GROUP = {"ddiloco.io/learner-group": "main"}
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
"""Not the chart's: the StatefulSet controller puts it on each pod (Kubernetes 1.28+), the pod's
ordinal, which is its shard with a sharded synchronizer. A synchronizer selector may add it to
pick one shard."""
CHAOS_LABEL = {"ddiloco.io/chaos": "true"}
LOCAL_KIND_ANNOTATION = "ddiloco.io/local-kind"
CHAOS_KINDS = {"PodChaos": "podChaos", "NetworkChaos": "networkChaos", "StressChaos": "stressChaos"}
LONGEST_FAULT_S = 30 * 60
"""No single fault may last longer than this."""
LONGEST_WORKFLOW_S = 60 * 60

MAPPING_HEADING = "## Local fault kinds and their Kubernetes experiments"


def local_kinds() -> set[str]:
    """The local driver's event kinds, a network fault as ``net/<fault>``."""
    return {k for k in KINDS if k != "net"} | {f"net/{f}" for f in NET_FAULTS}


def _is(kind: str, action: str | None, component: str, check: Callable[[dict], bool] = lambda spec: True):
    def predicate(chaos_kind: str, spec: dict) -> bool:
        return (chaos_kind == kind and (action is None or spec.get("action") == action)
                and _component(spec["selector"]) == component and check(spec))
    return predicate


def _targets_synchronizer(spec: dict) -> bool:
    return "target" in spec and _component(spec["target"]["selector"]) == "synchronizer"


EQUIVALENTS: dict[str, Callable[[str, dict], bool]] = {
    "kill": _is("PodChaos", None, "learner", lambda s: s.get("gracePeriod", 0) == 0),
    "stop": _is("StressChaos", None, "learner", lambda s: "cpu" in s.get("stressors", {})),
    "kill_synchronizer": _is("PodChaos", None, "synchronizer", lambda s: s.get("gracePeriod", 0) == 0),
    "drain": _is("PodChaos", "pod-kill", "learner", lambda s: s.get("gracePeriod", 0) >= 60),
    "net/latency": _is("NetworkChaos", "delay", "learner", _targets_synchronizer),
    "net/bandwidth": _is("NetworkChaos", "bandwidth", "learner", _targets_synchronizer),
    "net/blackhole": _is("NetworkChaos", "partition", "learner",
                         lambda s: _targets_synchronizer(s) and s.get("direction") == "both"),
    "net/stall": _is("NetworkChaos", "partition", "learner", _targets_synchronizer),
}
"""Local kinds that have a Chaos Mesh experiment, and what that experiment must look like."""

NO_EQUIVALENT = {"scale_up", "nan", "corrupt", "inflate", "overclaim", "net/reset", "wipe_synchronizer"}
"""Local kinds that Chaos Mesh cannot inject; the runbook gives the kubectl command instead."""


# -- loading ----------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(CHAOS_DIR.glob("*.yaml"))


def load_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in manifest_files():
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.name}#{i}", doc))
    return docs


DOCUMENTS = load_documents()
DOC_IDS = [name for name, _ in DOCUMENTS]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def readme() -> str:
    return README_PATH.read_text()


def errors(validator: jsonschema.Draft202012Validator, doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def parse_duration(text: str) -> float:
    """Seconds in a duration as the schema allows it (whole numbers of h, m, s, ms)."""
    if not re.fullmatch(r"([0-9]+(h|ms|m|s))+", text):
        raise ValueError(f"not a duration: {text!r}")
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(int(n) * unit[u] for n, u in re.findall(r"([0-9]+)(h|ms|m|s)", text))


def chaos_specs(doc: dict) -> Iterator[tuple[str, str, dict, str | None]]:
    """Every fault a document injects: (where, Chaos Mesh kind, spec, what bounds its length)."""
    kind, spec = doc["kind"], doc["spec"]
    if kind in CHAOS_KINDS:
        yield "spec", kind, spec, spec.get("duration")
    elif kind == "Schedule":
        inner = spec["type"]
        embedded = spec[CHAOS_KINDS[inner]]
        yield f"spec.{CHAOS_KINDS[inner]}", inner, embedded, embedded.get("duration")
    elif kind == "Workflow":
        for t in spec["templates"]:
            if t["templateType"] in CHAOS_KINDS:
                yield f"templates[{t['name']}]", t["templateType"], t[CHAOS_KINDS[t["templateType"]]], t.get("deadline")


def pod_selectors(node: Any, where: str = "") -> Iterator[tuple[str, dict]]:
    """Every Chaos Mesh pod selector (an object with ``selector`` and ``mode``), nested ones included."""
    if isinstance(node, dict):
        if "selector" in node and "mode" in node:
            yield where or "<root>", node
        for key, value in node.items():
            yield from pod_selectors(value, f"{where}.{key}" if where else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from pod_selectors(value, f"{where}[{i}]")


def _component(selector: dict) -> str | None:
    return selector.get("labelSelectors", {}).get(COMPONENT_LABEL)


def local_kind_annotation(doc: dict) -> set[str]:
    value = doc["metadata"].get("annotations", {}).get(LOCAL_KIND_ANNOTATION, "")
    return {v.strip() for v in value.split(",") if v.strip()}


def mapping_rows(readme: str) -> list[tuple[str | None, dict | None, str]]:
    """The runbook's mapping table: (local kind or None, the example event, the whole row)."""
    section = readme.split(MAPPING_HEADING, 1)[1]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "local event" or set(cells[0]) <= {"-"}:
            continue
        m = re.fullmatch(r"`(\{.*\})`", cells[0])
        if m is None:
            rows.append((None, None, line))
            continue
        event = yaml.safe_load(m.group(1))
        key = f"net/{event['net']}" if event["kind"] == "net" else event["kind"]
        rows.append((key, event, line))
    return rows


def cited_manifests(text: str) -> set[str]:
    return set(re.findall(r"k8s/chaos/([A-Za-z0-9_.-]+\.yaml)", text))


# -- the schema -------------------------------------------------------------------------------


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_there_are_experiments() -> None:
    assert len(DOCUMENTS) >= 10, "k8s/chaos holds fewer experiments than expected"
    names = [doc["metadata"]["name"] for _, doc in DOCUMENTS]
    assert len(names) == len(set(names)), "two experiments share a name"


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=DOC_IDS)
def test_manifest_validates_against_the_schema(validator, name: str, doc: dict) -> None:
    assert errors(validator, doc) == [], f"{name} does not validate"


# -- bounded in time --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=DOC_IDS)
def test_every_fault_ends_by_itself(name: str, doc: dict) -> None:
    specs = list(chaos_specs(doc))
    assert specs, f"{name} injects nothing"
    for where, kind, spec, bound in specs:
        assert bound is not None, f"{name} {where}: {kind} without a duration (or Workflow deadline)"
        assert 0 < parse_duration(bound) <= LONGEST_FAULT_S, f"{name} {where}: {bound} is not a bounded fault"
        if doc["kind"] == "Workflow":
            assert "duration" not in spec, f"{name} {where}: Chaos Mesh refuses a duration inside a Workflow"


@pytest.mark.parametrize(("name", "doc"), [d for d in DOCUMENTS if d[1]["kind"] == "Schedule"],
                         ids=[n for n, d in DOCUMENTS if d["kind"] == "Schedule"])
def test_a_schedule_never_overlaps_its_faults(name: str, doc: dict) -> None:
    spec = doc["spec"]
    assert spec.get("concurrencyPolicy") == "Forbid", f"{name}: two faults of one Schedule could overlap"
    m = re.fullmatch(r"@every (\S+)", spec["schedule"])
    assert m, f"{name}: use '@every <interval>' so the interval can be checked against the fault"
    fault = spec[CHAOS_KINDS[spec["type"]]]
    assert parse_duration(fault["duration"]) < parse_duration(m.group(1)), \
        f"{name}: each fault must end before the next one is due"


def _workflow_length(templates: dict[str, dict], name: str, seen: tuple[str, ...] = ()) -> float:
    assert name in templates, f"workflow step {name!r} is not defined"
    assert name not in seen, f"workflow steps form a cycle: {' -> '.join((*seen, name))}"
    t = templates[name]
    if t["templateType"] in ("Serial", "Parallel"):
        lengths = [_workflow_length(templates, c, (*seen, name)) for c in t["children"]]
        total = sum(lengths) if t["templateType"] == "Serial" else max(lengths)
        if "deadline" in t:
            assert total <= parse_duration(t["deadline"]), \
                f"step {name!r}: its deadline {t['deadline']} cuts its children ({total:.0f} s) short"
        return total
    return parse_duration(t["deadline"])


@pytest.mark.parametrize(("name", "doc"), [d for d in DOCUMENTS if d[1]["kind"] == "Workflow"],
                         ids=[n for n, d in DOCUMENTS if d["kind"] == "Workflow"])
def test_a_workflow_is_bounded_and_well_formed(name: str, doc: dict) -> None:
    templates = {t["name"]: t for t in doc["spec"]["templates"]}
    assert len(templates) == len(doc["spec"]["templates"]), f"{name}: two steps share a name"
    total = _workflow_length(templates, doc["spec"]["entry"])
    assert 0 < total <= LONGEST_WORKFLOW_S, f"{name}: runs {total:.0f} s"
    reachable: set[str] = set()
    stack = [doc["spec"]["entry"]]
    while stack:
        step = stack.pop()
        if step not in reachable:
            reachable.add(step)
            stack.extend(templates[step].get("children", []))
    assert reachable == set(templates), f"{name}: steps never run: {sorted(set(templates) - reachable)}"


# -- aimed at this project's pods only ----------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=DOC_IDS)
def test_selects_only_the_charts_pods_in_the_namespace(name: str, doc: dict) -> None:
    assert doc["metadata"]["namespace"] == NAMESPACE, f"{name}: the experiment lives outside {NAMESPACE}"
    selectors = list(pod_selectors(doc["spec"]))
    assert selectors, f"{name}: no pod selector"
    for where, pod_selector in selectors:
        selector = pod_selector["selector"]
        assert set(selector) == {"namespaces", "labelSelectors"}, \
            f"{name} {where}: select by namespace and the chart's labels only, not {sorted(selector)}"
        assert selector["namespaces"] == [NAMESPACE], f"{name} {where}: namespaces {selector['namespaces']}"
        labels = dict(selector["labelSelectors"])
        for key, value in CHART_LABELS.items():
            assert labels.pop(key, None) == value, f"{name} {where}: needs {key}: {value}"
        component = labels.pop(COMPONENT_LABEL, None)
        assert component in ("learner", "synchronizer"), f"{name} {where}: component {component!r}"
        if component == "learner":
            for key, value in LEARNER_GROUP.items():
                assert labels.pop(key, None) == value, f"{name} {where}: a learner selector needs {key}: {value}"
        if component == "synchronizer" and POD_INDEX_LABEL in labels:
            index = labels.pop(POD_INDEX_LABEL)
            assert re.fullmatch(r"0|[1-9][0-9]*", index), f"{name} {where}: {POD_INDEX_LABEL} {index!r} is no ordinal"
        assert labels == {}, f"{name} {where}: labels the chart does not set: {labels}"
    for where, _, spec, _ in chaos_specs(doc):
        if "containerNames" in spec:
            assert spec["containerNames"] == [_component(spec["selector"])], \
                f"{name} {where}: containerNames must name the selected component's container"


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=DOC_IDS)
def test_metadata_marks_the_experiment_and_its_local_kind(name: str, doc: dict) -> None:
    meta = doc["metadata"]
    assert meta["name"].startswith("ddiloco-"), f"{name}: name experiments ddiloco-..."
    for key, value in CHAOS_LABEL.items():
        assert meta.get("labels", {}).get(key) == value, f"{name}: label {key}={value} (used to stop them all)"
    kinds = local_kind_annotation(doc)
    assert kinds, f"{name}: annotation {LOCAL_KIND_ANNOTATION} missing"
    assert kinds <= local_kinds() | {"none"}, f"{name}: unknown local kinds {sorted(kinds - local_kinds())}"
    assert "none" not in kinds or kinds == {"none"}


# -- the runbook ------------------------------------------------------------------------------


def test_runbook_names_every_file_and_only_existing_ones(readme: str) -> None:
    mentioned = set(re.findall(r"k8s/chaos/([A-Za-z0-9_./-]*[A-Za-z0-9_])", readme))
    for rel in mentioned:
        assert (CHAOS_DIR / rel).exists(), f"README mentions k8s/chaos/{rel}, which does not exist"
    present = {p.relative_to(CHAOS_DIR).as_posix() for p in CHAOS_DIR.rglob("*") if p.suffix in (".yaml", ".json")}
    assert present - mentioned == set(), f"files the README does not mention: {sorted(present - mentioned)}"


def test_runbook_links_resolve(readme: str) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if re.match(r"[a-z]+://", target):
            continue
        assert (CHAOS_DIR / target).resolve().exists(), f"README links to {target}, which does not exist"
    assert "../../docs/faults.md" in readme, "the runbook must point to the local fault semantics"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_runbook_shows_how_to_apply_and_delete(readme: str, path: Path) -> None:
    rel = path.relative_to(ROOT).as_posix()
    assert f"kubectl apply -f {rel}" in readme
    assert f"kubectl delete -f {rel}" in readme


def test_runbook_cites_only_metrics_the_services_export(readme: str) -> None:
    source = "\n".join(p.read_text() for p in ROOT.glob("services/*/ddiloco/*/metrics.py"))
    exported = set(re.findall(r'"(ddiloco_[a-z_]+)"', source))
    cited = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bddiloco_[a-z_]+", readme)}
    cited.discard("ddiloco_")
    assert cited, "the runbook cites no metric"
    assert cited <= exported, f"metrics no service exports: {sorted(cited - exported)}"
    for needed in ("ddiloco_sync_merges_total", "ddiloco_sync_live_learners", "ddiloco_sync_staleness_versions",
                   "ddiloco_sync_contributions_total", "ddiloco_learner_blocked_seconds_total",
                   "ddiloco_learner_connected", "ddiloco_sync_fragment_version"):
        assert needed in cited, f"the runbook does not say what {needed} should do"


def test_runbook_uses_only_flags_ddiloco_status_has(readme: str, capsys) -> None:
    from ddiloco.protocol import status

    with pytest.raises(SystemExit):
        status.main(["--help"])
    known = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
    flag = r"(?<![\w-])--[a-z][a-z-]*"
    used = {f for line in readme.splitlines() if "ddiloco status" in line
            for f in re.findall(flag, line.split("ddiloco status", 1)[1])}
    described = [p for p in readme.split("\n\n") if p.strip().startswith("`ddiloco status` prints")]
    assert described, "the runbook does not describe what ddiloco status prints"
    used |= set(re.findall(flag, described[0]))
    assert "--synchronizer" in used
    assert used <= known, f"ddiloco status has no {sorted(used - known)}"
    assert "kubectl -n ddiloco port-forward svc/ddiloco-synchronizer 7000:7000" in readme
    assert "ddiloco status --synchronizer 127.0.0.1:7000" in readme


RENDER_SED = (
    r's/^\( *namespace:\) ddiloco\$/\1 $NS/',
    r's/namespaces: \[ddiloco\]/namespaces: [$NS]/',
    r's|app.kubernetes.io/instance: ddiloco\$|app.kubernetes.io/instance: $RELEASE|',
)


def _render(text: str, ns: str, release: str) -> str:
    """What the runbook's ``render`` shell function does, in Python."""
    text = re.sub(r"^( *namespace:) ddiloco$", rf"\1 {ns}", text, flags=re.M)
    text = text.replace("namespaces: [ddiloco]", f"namespaces: [{ns}]")
    return re.sub(r"app\.kubernetes\.io/instance: ddiloco$", f"app.kubernetes.io/instance: {release}",
                  text, flags=re.M)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_runbook_rendering_moves_namespace_and_release_only(readme: str, validator, path: Path) -> None:
    for expression in RENDER_SED:
        assert expression in readme, f"the runbook's render function changed: {expression} not found"
    original = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    rendered = [d for d in yaml.safe_load_all(_render(path.read_text(), "training", "llm")) if d is not None]
    for before, after in zip(original, rendered, strict=True):
        assert errors(validator, after) == []
        assert after["metadata"]["namespace"] == "training"
        for _, pod_selector in pod_selectors(after["spec"]):
            assert pod_selector["selector"]["namespaces"] == ["training"]
            assert pod_selector["selector"]["labelSelectors"]["app.kubernetes.io/instance"] == "llm"
        # nothing else moved
        back = yaml.safe_load(
            json.dumps(after).replace('"training"', '"ddiloco"').replace('"llm"', '"ddiloco"'))
        assert back == before


# -- the local driver's kinds -----------------------------------------------------------------


def test_every_local_kind_is_classified() -> None:
    """A new kind in the local driver fails here until it is given an experiment or marked as having none."""
    assert set(EQUIVALENTS) | NO_EQUIVALENT == local_kinds()
    assert set(EQUIVALENTS) & NO_EQUIVALENT == set()


def test_runbook_mapping_examples_are_valid_local_events(readme: str) -> None:
    rows = mapping_rows(readme)
    assert rows, "the runbook has no mapping table"
    for key, event, line in rows:
        if event is None:
            continue
        build(FaultEvent, event, f"README mapping row {line!r}")
        assert key in local_kinds(), line


def test_runbook_mapping_covers_every_local_kind(readme: str) -> None:
    rows = mapping_rows(readme)
    keys = {key for key, _, _ in rows if key is not None}
    assert keys == local_kinds(), f"kinds missing from the mapping: {sorted(local_kinds() - keys)}"
    for key, _, line in rows:
        if key in NO_EQUIVALENT:
            assert "no Chaos Mesh equivalent" in line and not cited_manifests(line), line
        elif key is not None:
            assert cited_manifests(line), f"the mapping of {key} cites no experiment"


@pytest.mark.parametrize("local_kind", sorted(EQUIVALENTS))
def test_local_kind_with_an_equivalent_has_its_experiment(readme: str, local_kind: str) -> None:
    by_file = {name.split("#")[0]: doc for name, doc in DOCUMENTS}
    cited = set().union(*(cited_manifests(line) for key, _, line in mapping_rows(readme) if key == local_kind))
    assert cited, f"the runbook maps {local_kind} to no experiment"
    for file in cited:
        doc = by_file[file]
        assert local_kind in local_kind_annotation(doc), f"{file} is not annotated {local_kind}"
        assert all(EQUIVALENTS[local_kind](kind, spec) for _, kind, spec, _ in chaos_specs(doc)), \
            f"{file} does not inject what {local_kind} does"


def test_annotations_agree_with_the_mapping(readme: str) -> None:
    rows = mapping_rows(readme)
    for name, doc in DOCUMENTS:
        if doc["kind"] == "Workflow":  # a sequence of the others, not a row of its own
            continue
        file = name.split("#")[0]
        rows_citing = [key for key, _, line in rows if file in cited_manifests(line)]
        assert rows_citing, f"{file} is in no row of the mapping"
        assert set(rows_citing) - {None} == local_kind_annotation(doc) - {"none"}, \
            f"{file}: annotated {sorted(local_kind_annotation(doc))}, mapped from {rows_citing}"


# -- the schema refuses mistakes --------------------------------------------------------------


def _doc(file: str) -> dict:
    return copy.deepcopy(next(d for n, d in DOCUMENTS if n == f"{file}#0"))


Path_ = str | tuple[str, ...]
"""Where in a document: dotted keys ("spec.delay.latency", list indices as numbers), or a tuple of
keys when a key holds dots itself (label keys)."""


def _walk(doc: dict, path: Path_) -> tuple[Any, str]:
    *parents, last = path.split(".") if isinstance(path, str) else path
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    return node, last


def _set(path: Path_, value: Any) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node, last = _walk(doc, path)
        node[last] = value
    return mutate


def _del(path: Path_) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node, last = _walk(doc, path)
        del node[last]
    return mutate


def _rename(path: Path_, new: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node, last = _walk(doc, path)
        node[new] = node.pop(last)
    return mutate


def _both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        for m in mutations:
            m(doc)
    return mutate


POD = "learner-pod-kill.yaml"
DELAY = "network-delay.yaml"
STRESS = "learner-cpu-stress.yaml"
SCHEDULE = "learner-pod-kill-schedule.yaml"
WORKFLOW = "workflow-fault-sequence.yaml"
BANDWIDTH = "network-bandwidth.yaml"
LOSS = "network-loss.yaml"

REJECTED: dict[str, tuple[str, Callable[[dict], None]]] = {
    # misspelt fields, at every level the schema defines
    "misspelt top-level field": (POD, _rename("metadata", "metdata")),
    "misspelt metadata field": (POD, _rename("metadata.namespace", "namspace")),
    "misspelt spec field": (POD, _rename("spec.duration", "duraton")),
    "misspelt selector field": (POD, _rename("spec.selector.labelSelectors", "labelSelector")),
    "misspelt target field": (DELAY, _rename("spec.target.selector", "selectors")),
    "misspelt delay field": (DELAY, _rename("spec.delay.latency", "latencey")),
    "misspelt stressor": (STRESS, _rename("spec.stressors.cpu", "cpus")),
    "misspelt stressor field": (STRESS, _rename("spec.stressors.cpu.workers", "worker")),
    "misspelt schedule field": (SCHEDULE, _rename("spec.concurrencyPolicy", "concurrency")),
    "misspelt workflow template field": (WORKFLOW, _rename("spec.templates.1.deadline", "deadlne")),
    # unknown names
    "unknown PodChaos action": (POD, _set("spec.action", "pod-explode")),
    "unknown NetworkChaos action": (DELAY, _set("spec.action", "slow")),
    "unknown mode": (POD, _set("spec.mode", "some")),
    "unknown direction": (DELAY, _set("spec.direction", "sideways")),
    "unknown kind": (POD, _set("kind", "IOChaos")),
    "wrong apiVersion": (POD, _set("apiVersion", "chaos-mesh.org/v1")),
    "unknown Schedule type": (SCHEDULE, _set("spec.type", "TimeChaos")),
    "unknown concurrency policy": (SCHEDULE, _set("spec.concurrencyPolicy", "Replace")),
    "unknown workflow step type": (WORKFLOW, _set("spec.templates.0.templateType", "Sequence")),
    # durations
    "PodChaos without duration": (POD, _del("spec.duration")),
    "NetworkChaos without duration": (DELAY, _del("spec.duration")),
    "StressChaos without duration": (STRESS, _del("spec.duration")),
    "Schedule's fault without duration": (SCHEDULE, _del("spec.podChaos.duration")),
    "Workflow chaos step without deadline": (WORKFLOW, _del("spec.templates.1.deadline")),
    "Workflow pause without deadline": (WORKFLOW, _del("spec.templates.2.deadline")),
    "duration inside a Workflow step": (WORKFLOW, _set("spec.templates.1.podChaos.duration", "30s")),
    "duration in words": (POD, _set("spec.duration", "5 minutes")),
    "duration without unit": (POD, _set("spec.duration", "60")),
    "duration as a number": (POD, _set("spec.duration", 60)),
    "negative duration": (POD, _set("spec.duration", "-5s")),
    "zero duration": (POD, _set("spec.duration", "0s")),
    "empty duration": (POD, _set("spec.duration", "")),
    "fractional duration": (POD, _set("spec.duration", "1.5h")),
    "unknown duration unit": (POD, _set("spec.duration", "5M")),
    "day duration unit": (POD, _set("spec.duration", "1d")),
    "latency without unit": (DELAY, _set("spec.delay.latency", "200")),
    # modes and their values
    "mode fixed without value": (POD, _set("spec.mode", "fixed")),
    "mode fixed with value 0": (POD, _both(_set("spec.mode", "fixed"), _set("spec.value", "0"))),
    "mode fixed with a number value": (POD, _both(_set("spec.mode", "fixed"), _set("spec.value", 2))),
    "mode fixed-percent without value": (POD, _set("spec.mode", "fixed-percent")),
    "mode fixed-percent over 100": (POD, _both(_set("spec.mode", "fixed-percent"), _set("spec.value", "150"))),
    "mode random-max-percent without value": (POD, _set("spec.mode", "random-max-percent")),
    "mode one with a value": (POD, _set("spec.value", "1")),
    "target mode fixed without value": (DELAY, _set("spec.target.mode", "fixed")),
    # selectors
    "selector without namespaces": (POD, _del("spec.selector.namespaces")),
    "selector of a whole namespace": (POD, _del("spec.selector.labelSelectors")),
    "label value that is not a string": (POD, _set(("spec", "selector", "labelSelectors", "app.kubernetes.io/name"), 1)),
    "target without mode": (DELAY, _del("spec.target.mode")),
    # action parameters
    "delay action without delay": (DELAY, _del("spec.delay")),
    "delay action with loss parameters": (DELAY, _set("spec.loss", {"loss": "10"})),
    "partition with delay parameters": ("learner-partition.yaml", _set("spec.delay", {"latency": "1s"})),
    "loss as a number": (LOSS, _set("spec.loss.loss", 10)),
    "loss over 100%": (LOSS, _set("spec.loss.loss", "150")),
    "bandwidth rate without unit": (BANDWIDTH, _set("spec.bandwidth.rate", "2000000")),
    "bandwidth rate in words": (BANDWIDTH, _set("spec.bandwidth.rate", "fast")),
    "bandwidth limit 0": (BANDWIDTH, _set("spec.bandwidth.limit", 0)),
    "bandwidth without buffer": (BANDWIDTH, _del("spec.bandwidth.buffer")),
    "both directions without a target": (LOSS, _del("spec.target")),
    "container-kill without containerNames": (POD, _set("spec.action", "container-kill")),
    "gracePeriod on pod-failure": (POD, _both(_set("spec.action", "pod-failure"), _set("spec.gracePeriod", 30))),
    "negative gracePeriod": (POD, _set("spec.gracePeriod", -1)),
    "no stressors": (STRESS, _del("spec.stressors")),
    "empty stressors": (STRESS, _set("spec.stressors", {})),
    "zero stress workers": (STRESS, _set("spec.stressors.cpu.workers", 0)),
    "stress load over 100": (STRESS, _set("spec.stressors.cpu.load", 150)),
    # Schedule and Workflow structure
    "Schedule whose fault is not of its type": (SCHEDULE, _rename("spec.podChaos", "networkChaos")),
    "schedule in words": (SCHEDULE, _set("spec.schedule", "every 5 minutes")),
    "Workflow serial step without children": (WORKFLOW, _del("spec.templates.0.children")),
    "Workflow chaos step without its fault": (WORKFLOW, _del("spec.templates.1.podChaos")),
    # metadata
    "missing namespace": (POD, _del("metadata.namespace")),
    "missing name": (POD, _del("metadata.name")),
    "name with capitals": (POD, _set("metadata.name", "Ddiloco-Kill")),
    "missing spec": (POD, _del("spec")),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_schema_rejects(validator, case: str) -> None:
    file, mutate = REJECTED[case]
    doc = _doc(file)
    mutate(doc)
    assert errors(validator, doc), f"the schema accepts: {case}"


ACCEPTED: dict[str, tuple[str, Callable[[dict], None]]] = {
    "mode fixed with a count": (POD, _both(_set("spec.mode", "fixed"), _set("spec.value", "2"))),
    "mode fixed-percent": (POD, _both(_set("spec.mode", "fixed-percent"), _set("spec.value", "50"))),
    "mode random-max-percent 100": (POD, _both(_set("spec.mode", "random-max-percent"), _set("spec.value", "100"))),
    "mode all": (POD, _set("spec.mode", "all")),
    "compound duration": (POD, _set("spec.duration", "1h30m")),
    "duration in ms": (POD, _set("spec.duration", "500ms")),
    "minutes and seconds": (POD, _set("spec.duration", "1m30s")),
    "fractional latency": (DELAY, _set("spec.delay.latency", "0.5s")),
    "memory stressor": (STRESS, _set("spec.stressors.memory", {"workers": 1, "size": "256MB"})),
    "direction both with a target": (DELAY, _set("spec.direction", "both")),
    "cron schedule": (SCHEDULE, _set("spec.schedule", "*/5 * * * *")),
    "expression selector": (POD, _set("spec.selector.expressionSelectors",
                                      [{"key": "ddiloco.io/learner-group", "operator": "In", "values": ["main"]}])),
    "pause annotation": (POD, _set(("metadata", "annotations", "experiment.chaos-mesh.org/pause"), "true")),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_schema_accepts_what_chaos_mesh_accepts(validator, case: str) -> None:
    file, mutate = ACCEPTED[case]
    doc = _doc(file)
    mutate(doc)
    assert errors(validator, doc) == [], f"the schema refuses: {case}"


def test_duration_parser() -> None:
    assert parse_duration("1h30m") == 5400
    assert parse_duration("500ms") == 0.5
    assert parse_duration("1m30s") == 90
    with pytest.raises(ValueError):
        parse_duration("5 minutes")
