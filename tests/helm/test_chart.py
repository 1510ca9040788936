"""The Helm chart deploy/helm/gpu-node-agent, rendered by the pinned Helm (tests/helm/helm.py):
it lints strictly; with the values in tests/helm/values/ it renders exactly the objects of the
kustomize tree it mirrors (`daemonset/`, the openshift and mig-manager overlays), so an edit
to one side only fails here; its images, Secrets and values do what values.yaml says."""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import agent
from agent.api.auth import TokenStore
from tests.deploy.manifests import by_name, container, render
from tests.deploy.test_manifests import CRD_KINDS, K8S_VERSIONS, crd_schema
from tests.helm.helm import CHART, ROOT, VALUES, differences, run, template

IMAGE = "ghcr.io/gpu-node-agent/gpu-node-agent"
DIGEST = "sha256:" + "0123456789abcdef" * 4
Json = dict[str, Any]

#: Each kustomize tree and the values file that mirrors it.
MIRRORS = [("daemonset", "kustomize.yaml"), ("daemonset/overlays/openshift", "openshift.yaml"),
           ("daemonset/overlays/mig-manager", "mig-manager.yaml")]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "helm-home"


def images(docs: list[Json]) -> set[str]:
    """Every container image of every pod template."""
    return {c["image"] for d in docs if d["kind"] == "DaemonSet"
            for c in d["spec"]["template"]["spec"]["containers"]}


def kind(docs: list[Json], wanted: str) -> list[Json]:
    return [d for d in docs if d["kind"] == wanted]


@pytest.mark.parametrize("values", [[], ["everything.yaml"], *([v] for _, v in MIRRORS)],
                         ids=["defaults", "everything", *(v for _, v in MIRRORS)])
def test_the_chart_lints_strictly(home: Path, values: list[str]) -> None:
    """``helm lint --strict`` (warnings are failures) passes with the defaults, with every
    feature on, and with each mirror of a kustomize tree."""
    args = [a for v in values for a in ("--values", str(VALUES / v))]
    done = run(home, "lint", "--strict", str(CHART), *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.parametrize(("tree", "values"), MIRRORS, ids=[v for _, v in MIRRORS])
def test_the_chart_installs_what_kustomize_installs(home: Path, tree: str, values: str) -> None:
    """With the values mirroring a kustomize tree the chart renders the same objects, kind,
    namespace, name and every field, but for Helm's own labels."""
    assert differences(template(home, values=[VALUES / values]), render(tree)) == []


#: Edits to one side, each of which the comparison must report (a file, the text in it, its
#: replacement; or chart values set on top of the mirror's).
ONE_SIDED = [
    ("base/daemonset.yaml", "--agent-lost-after=60", "--agent-lost-after=30"),
    ("base/deviceclasses.yaml", '.type == "gpu"', '.type == "GPU"'),
    ("base/rbac.yaml", "verbs: [get, list, watch, patch]\n---", "verbs: [get, list, watch]\n---"),
    ("base/kustomization.yaml", 'newTag: "0.2.0"', 'newTag: "0.2.1"'),
    ("base/prometheusrule.yaml", "for: 1m", "for: 2m"),
]
CHART_EDITS = [["deviceClasses.gpu.extendedResourceName=nvidia.com/gpu"],
               ["features.gpuShares=true"], ["monitoring.dashboard=false"],
               ["driverRoot=/opt/nvidia"], ["kubeletPlugin.extraArgs={--verbose}"]]


@pytest.mark.parametrize(("path", "old", "new"), ONE_SIDED, ids=[p for p, _, _ in ONE_SIDED])
def test_an_edit_to_the_kustomize_tree_alone_is_a_difference(
        home: Path, tmp_path: Path, path: str, old: str, new: str) -> None:
    tree = tmp_path / "daemonset"
    shutil.copytree(ROOT / "daemonset", tree)
    text = (tree / path).read_text()
    assert text.count(old) >= 1, f"{path} no longer has {old!r}: update this case"
    (tree / path).write_text(text.replace(old, new, 1))
    assert differences(template(home, values=[VALUES / "kustomize.yaml"]), render(str(tree)))


@pytest.mark.parametrize("sets", CHART_EDITS, ids=[s[0] for s in CHART_EDITS])
def test_an_edit_to_the_chart_alone_is_a_difference(home: Path, sets: list[str]) -> None:
    assert differences(template(home, values=[VALUES / "kustomize.yaml"], sets=sets),
                       render("daemonset"))


def test_the_chart_files_are_the_monitoring_files() -> None:
    """files/ holds copies of daemonset/monitoring/ (Helm reads only files inside a chart)."""
    for name in ("gpu-node-agent-alerts.yaml", "gpu-node-agent-rules.yaml",
                 "gpu-node-agent-dashboard.json"):
        assert (CHART / "files" / name).read_bytes() == \
            (ROOT / "daemonset" / "monitoring" / name).read_bytes(), name


def test_chart_version_and_app_version_are_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], str(chart["appVersion"])) == (agent.__version__,) * 2


@pytest.mark.parametrize(("sets", "expected"), [
    ([], f"{IMAGE}:{agent.__version__}"),
    (["image.tag=1.2.3"], f"{IMAGE}:1.2.3"),
    ([f"image.digest={DIGEST}"], f"{IMAGE}@{DIGEST}"),
    (["image.tag=1.2.3", f"image.digest={DIGEST}"], f"{IMAGE}@{DIGEST}"),
    (["image.registry=registry.example.com:5000", "image.repository=gpu/agent"],
     f"registry.example.com:5000/gpu/agent:{agent.__version__}"),
    (["image.registry=", "image.repository=gpu-node-agent"], f"gpu-node-agent:{agent.__version__}"),
], ids=["default", "tag", "digest", "digest-over-tag", "registry", "no-registry"])
def test_every_container_runs_the_chosen_image(home: Path, sets: list[str],
                                               expected: str) -> None:
    """All three containers (agent, plugin, MPS host) run one image: by default the tag of
    the package's version, which is the kustomize base's too; a digest wins over a tag."""
    docs = template(home, sets=sets)
    assert images(docs) == {expected}
    assert len([c for d in kind(docs, "DaemonSet")
                for c in d["spec"]["template"]["spec"]["containers"]]) == 3


def test_the_kustomize_image_is_the_package_version() -> None:
    assert images(render("daemonset")) == {f"{IMAGE}:{agent.__version__}"}


@pytest.mark.parametrize(("sets", "message"), [
    (["image.digest=latest"], "image.digest"),
    (["features.gpuShares=true", "features.dynamicMig=true"], "features.gpuShares"),
    (["migManager.enabled=true", "migManager.configMap=default-mig-parted-config"],
     "migManager.configMap"),
    (["driverRoot=run/nvidia/driver"], "driverRoot"),
])
def test_values_that_cannot_work_are_refused_when_rendering(home: Path, sets: list[str],
                                                            message: str) -> None:
    """A digest that is not one, flags the agent refuses together, a ConfigMap that is not
    NAMESPACE/NAME, a relative driver root: `helm template` (and install) fails naming the
    value, rather than a pod crash-looping on a node."""
    args = [a for s in sets for a in ("--set", s)]
    done = run(home, "template", "gpu-node-agent", str(CHART), *args)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["", "nvidia.com/gpu", "example.com/gpu"])
def test_extended_resource_name_is_on_the_gpu_class_only_when_set(home: Path, name: str) -> None:
    docs = template(home, sets=[f"deviceClasses.gpu.extendedResourceName={name}"])
    classes = {d["metadata"]["name"]: d["spec"] for d in kind(docs, "DeviceClass")}
    assert set(classes) == {d["metadata"]["name"] for d in kind(render("daemonset"),
                                                                "DeviceClass")}
    assert classes["gpu.nodeagent.dev"].get("extendedResourceName") == (name or None)
    assert all("extendedResourceName" not in spec for class_name, spec in classes.items()
               if class_name != "gpu.nodeagent.dev")


@pytest.mark.parametrize("mig", [False, True], ids=["claims", "mig-manager"])
def test_generated_tokens_are_what_the_pods_mount(home: Path, tmp_path: Path, mig: bool) -> None:
    """Without tokens.existingSecret the chart makes gpu-node-agent-tokens with every key the
    DaemonSet mounts; the agent accepts its token file, in which the plugin's token has the
    claims scope only (and its mig token geometry and read), and an admin token is yours."""
    docs = template(home, sets=[f"migManager.enabled={str(mig).lower()}"])
    secret = by_name(docs, "Secret", "gpu-node-agent-tokens")
    data = {k: _b64(v) for k, v in secret["data"].items()}
    pod = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    mounted = {item["key"] for v in pod["volumes"] if v.get("secret", {}).get("secretName")
               == "gpu-node-agent-tokens" for item in v["secret"]["items"]}
    assert mounted == {"tokens", "kubelet-plugin-token", *(["kubelet-plugin-mig-token"]
                                                           if mig else [])}
    assert set(data) == mounted | {"admin-token"}
    path = tmp_path / "tokens"
    path.write_text(data["tokens"])
    path.chmod(0o400)
    store = TokenStore.load(path)
    plugin = store.authenticate(f"Bearer {data['kubelet-plugin-token']}")
    assert (plugin.name, plugin.scopes) == ("kubelet-plugin", {"claims"})
    assert store.authenticate(f"Bearer {data['admin-token']}").scopes >= {"admin"}
    if mig:
        assert store.authenticate(f"Bearer {data['kubelet-plugin-mig-token']}").scopes == {
            "geometry", "read"}
    assert len({data[k] for k in data if k != "tokens"}) == len(data) - 1  # all distinct
    tls = by_name(docs, "Secret", "gpu-node-agent-tls")
    assert tls["type"] == "kubernetes.io/tls"
    assert _b64(tls["data"]["tls.crt"]).startswith("-----BEGIN CERTIFICATE-----")


def test_existing_secrets_are_mounted_and_none_is_generated(home: Path) -> None:
    docs = template(home, sets=["tokens.existingSecret=mine", "tls.existingSecret=my-tls"])
    assert kind(docs, "Secret") == []
    pod = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {
        "mine", "my-tls"}


def test_values_reach_the_pods_and_the_policies(home: Path) -> None:
    """Every value of everything.yaml lands where it should: placement on both DaemonSets,
    the feature flags, the driver root, the release namespace in every policy and binding."""
    docs = template(home, values=[VALUES / "everything.yaml"], namespace="gpu-system")
    wanted = yaml.safe_load((VALUES / "everything.yaml").read_text())
    wanted["nodeSelector"] = {k: v for k, v in wanted["nodeSelector"].items() if v is not None}
    for ds in kind(docs, "DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                    "imagePullSecrets"):
            assert pod[key] == wanted[key], (ds["metadata"]["name"], key)
        assert ds["metadata"]["namespace"] == "gpu-system"
    pod = by_name(docs, "DaemonSet", "gpu-node-agent")["spec"]["template"]["spec"]
    agent_args, plugin_args = container(pod, "agent")["args"], container(pod, "kubelet-plugin")[
        "args"]
    assert {"--dynamic-mig", "--no-execute-taints", "--collect-interval=10",
            "--driver-root=/opt/nvidia/driver"} <= set(agent_args)
    assert "--gpu-shares" not in agent_args
    assert {"--mig-config-map=gpu-ops/mig-parted", "--claim-read-timeout=20"} <= set(plugin_args)
    user = "system:serviceaccount:gpu-system:gpu-node-agent"
    for policy in kind(docs, "ValidatingAdmissionPolicy"):
        (condition,) = policy["spec"]["matchConditions"]
        assert condition["expression"] == f'request.userInfo.username == "{user}"'
    assert by_name(docs, "SecurityContextConstraints", "gpu-node-agent")["users"] == [user]
    for binding in [*kind(docs, "ClusterRoleBinding"), *kind(docs, "RoleBinding")]:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent",
                                        "namespace": "gpu-system"}]
    role = by_name(docs, "Role", "gpu-node-agent-mig-config")
    assert role["metadata"]["namespace"] == "gpu-ops"
    assert role["rules"][0]["resourceNames"] == ["mig-parted"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", [[], ["everything.yaml"]], ids=["defaults", "everything"])
def test_every_rendered_object_validates(home: Path, values: list[str], version: str) -> None:
    """Unknown fields are errors, as in tests/deploy/test_manifests.py for the kustomize tree."""
    docs = template(home, values=[VALUES / v for v in values])
    assert docs
    for doc in docs:
        crd = CRD_KINDS.get((doc["apiVersion"], doc["kind"]))
        if crd is not None:
            jsonschema.validate(copy.deepcopy(doc), crd_schema(crd))
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def _b64(text: str) -> str:
    return base64.b64decode(text).decode()


DEPLOY = ROOT / "docs" / "deploy.md"


def helm_section() -> str:
    return DEPLOY.read_text().split("\n## Helm\n", 1)[1].split("\n## ", 1)[0]


def documented_values() -> list[tuple[str, str]]:
    """(value, default cell) of each row of docs/deploy.md's Helm values table."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in helm_section().splitlines() if line.startswith("| `")]
    return [(row[0].strip("`"), row[1]) for row in rows]


def test_the_documented_values_and_defaults_are_the_charts() -> None:
    """Every value the Helm section's table names is in values.yaml, with the default the
    table shows where it shows one literally (backticked)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = documented_values()
    assert len(table) >= 15
    for name, default in table:
        node: Any = values
        for part in name.split("."):
            assert isinstance(node, dict) and part in node, f"{name} is not in values.yaml"
            node = node[part]
        if default.startswith("`") and default.endswith("`"):
            assert yaml.safe_load(default.strip("`")) == node, name


def test_the_documented_namespace_labels_are_the_charts(home: Path) -> None:
    """The Helm section's `kubectl label namespace` sets the labels the chart's Namespace (and
    the kustomize base's) has: the privileged pod-security level."""
    (line,) = [line for line in helm_section().replace("\\\n", " ").splitlines()
               if line.startswith("kubectl label namespace")]
    documented = dict(word.split("=", 1) for word in line.split()[4:])
    namespace = by_name(template(home, sets=["namespace.create=true"]), "Namespace",
                        "gpu-node-agent")
    labels = namespace["metadata"]["labels"]
    assert documented == {k: v for k, v in labels.items() if k.startswith("pod-security.")}
    assert documented == {f"pod-security.kubernetes.io/{m}": "privileged"
                          for m in ("enforce", "audit", "warn")}
