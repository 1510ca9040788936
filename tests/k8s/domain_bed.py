"""A rack-scale test bed for compute domains: a 1.37 API server, kube-scheduler and, per
simulated GB200 NVL72 node, a real agent (with its simulated IMEX), a real kubelet plugin and
kubelet's DRA manager; the nodes split between two NVLink cliques. Used by
tests/k8s/test_compute_domains.py (a small bed) and bench/compute_domains.py (18 + 2 nodes,
the issue's rack).

A job is what a user applies: one ResourceClaim for the domain (``count`` slots of the
compute-domain class, ``matchAttribute`` on the clique) shared by its pods, and per pod a
claim of all four GPUs of a node (one pod a node). No kubelet runs pods here: a "prepare" is
kubelet's DRA manager preparing the pod's claims through the plugin, as kubelet does before
it starts the containers, retried as kubelet's pod sync retries it."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.k8s.harness import NEWEST, ApiServer, KubeScheduler, schedulable_node
from tests.k8s.scheduling import RESOURCE, create_workload
from tests.k8s.stack import (
    DEVICE_CLASSES,
    PLUGIN_NAMESPACE,
    Stack,
    apply_shipped,
    plugin_kubeconfig,
    stack_factory,
)
from tests.waiting import wait_for

Json = dict[str, Any]
DOMAIN_CLASS = "compute-domain.gpu.nodeagent.dev"
MEMBER_ANNOTATION = "gpu.nodeagent.dev/compute-domain-member"
GPU_CLASS = "gpu.nodeagent.dev"
CLIQUE_ATTRIBUTE = "gpu.nodeagent.dev/fabricClique"
#: Two racks: their fabric's cluster UUIDs, clique 1 each.
RACKS = ("6c3a0d1e-0a5b-4c8e-9f1a-1b2c3d4e5f60", "7d4b1e2f-1b6c-4d9f-8a2b-2c3d4e5f6071")
#: The simulated nodes' IMEX addresses: 127.0.<ADDRESS_BLOCK>.<n> (one bed runs at a time).
ADDRESS_BLOCK = 90
#: The pytest-xdist group of every test starting a bed: one worker runs them one after the
#: other, since their beds share the address block and IMEX's port.
BED_GROUP = "compute-domain-bed"


@dataclass(frozen=True)
class BedSize:
    """Nodes in the first clique and in the second."""

    first: int
    second: int


@dataclass
class Job:
    """A domain job as submitted: its namespace, the domain claim and the pods."""

    namespace: str
    claim: str
    pods: list[str]
    uid: str = ""


@dataclass
class DomainBed:
    server: ApiServer
    scheduler: KubeScheduler
    stacks: dict[str, Stack]
    cliques: dict[str, str]
    addresses: dict[str, str]
    _close: Callable[[], None]
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(32))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._close()

    # --- jobs ------------------------------------------------------------------------------

    def submit(self, namespace: str, nodes: int, *, name: str = "job") -> Job:
        """A job of ``nodes`` pods sharing one domain claim of ``nodes`` slots."""
        claim = f"{name}-domain"
        docs: list[Json] = [
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": claim},
             "spec": {"devices": {
                 "requests": [{"name": "nodes", "exactly": {
                     "deviceClassName": DOMAIN_CLASS, "allocationMode": "ExactCount",
                     "count": nodes}}],
                 "constraints": [{"requests": ["nodes"], "matchAttribute": CLIQUE_ATTRIBUTE}]}}},
            _gpus_template(f"{name}-gpus")]
        pods = [f"{name}-{i}" for i in range(nodes)]
        docs += [_pod(pod, name, claim, f"{name}-gpus") for pod in pods]
        create_workload(self.server, docs, namespace)
        status, body = self.server.request(
            "GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{claim}")
        assert status == 200, body
        return Job(namespace, claim, pods, uid=body["metadata"]["uid"])

    def add_pod(self, job: Job, pod: str) -> None:
        """One more pod of the job sharing its domain claim (what its controller makes when a
        pod is lost), with a GPU claim of its own."""
        name = job.claim.removesuffix("-domain")
        create_workload(self.server, [_gpus_template(f"{pod}-gpus"),
                                      _pod(pod, name, job.claim, f"{pod}-gpus")], job.namespace)
        job.pods.append(pod)

    def pod(self, job: Job, pod: str) -> Json:
        status, body = self.server.request("GET",
                                           f"/api/v1/namespaces/{job.namespace}/pods/{pod}")
        assert status == 200, body
        return dict(body)

    def bound(self, job: Job) -> dict[str, str]:
        """Pod -> node for the job's pods the scheduler has bound so far."""
        found = {}
        for pod in job.pods:
            node = self.pod(job, pod)["spec"].get("nodeName")
            if node:
                found[pod] = node
        return found

    def prepare(self, job: Job, pod: str, node: str, *, within_s: float) -> Json:
        """Kubelet's DRA manager on ``node`` prepares the pod's claims, again while it fails
        (kubelet's pod sync), up to ``within_s``; the last answer."""
        kubelet = self.stacks[node].kubelet
        assert kubelet is not None
        deadline = time.monotonic() + within_s
        while True:
            answer = kubelet.prepare(f"{job.namespace}/{pod}", timeout=within_s)
            if answer.get("ok") or time.monotonic() > deadline:
                return answer

    def preparing(self, job: Job, pod: str, node: str, *,
                  within_s: float = 120) -> Future[Json]:
        """:meth:`prepare` in the background (its answer is the future's)."""
        return self._pool.submit(self.prepare, job, pod, node, within_s=within_s)

    def prepare_all(self, job: Job, placed: dict[str, str], *,
                    within_s: float = 120) -> dict[str, Json]:
        """Every pod prepared on its node at once (the kubelets of a job's nodes work in
        parallel, and a domain forms only when its members join together)."""
        futures = {pod: self.preparing(job, pod, node, within_s=within_s)
                   for pod, node in placed.items()}
        return {pod: future.result() for pod, future in futures.items()}

    def unprepare_all(self, job: Job, placed: dict[str, str], *,
                      within_s: float = 60) -> dict[str, Json]:
        """Every pod unprepared on its node at once, again while it fails (kubelet retries an
        unprepare too: a plugin just restarted may be registered again a moment later)."""
        def unprepare(pod: str, node: str) -> Json:
            kubelet = self.stacks[node].kubelet
            assert kubelet is not None
            answers: list[Json] = []

            def done() -> bool:
                answers.append(kubelet.unprepare(f"{job.namespace}/{pod}"))
                return bool(answers[-1].get("ok"))

            with contextlib.suppress(AssertionError):  # the last answer says why
                wait_for(done, f"{pod} unprepared on {node}", within_s, every_s=0.2)
            return answers[-1]
        futures = {pod: self._pool.submit(unprepare, pod, node) for pod, node in placed.items()}
        return {pod: future.result() for pod, future in futures.items()}

    def release(self, job: Job) -> None:
        """Remove the job as the controllers a real cluster runs would once its pods end:
        the pods (no kubelet confirms their deletion), then its claims deallocated and
        deleted (no resourceclaim controller does it here), so its nodes are free again."""
        names = {job.claim}
        for pod in job.pods:
            body = self.pod(job, pod)
            names.update(s["resourceClaimName"]
                         for s in body["status"].get("resourceClaimStatuses", []))
            status, answer = self.server.request(
                "DELETE", f"/api/v1/namespaces/{job.namespace}/pods/{pod}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            assert status in (200, 202, 404), answer
        for name in names:
            path = f"{RESOURCE}/namespaces/{job.namespace}/resourceclaims/{name}"
            self.server.kubectl("patch", "resourceclaim", "-n", job.namespace, name,
                                "--subresource=status", "--type=merge", "-p",
                                '{"status": {"allocation": null, "reservedFor": null}}')
            self.server.kubectl("patch", "resourceclaim", "-n", job.namespace, name,
                                "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
            status, answer = self.server.request("DELETE", path)
            assert status in (200, 202, 404), answer

    # --- what the nodes say ------------------------------------------------------------------

    def member(self, node: str) -> Json | None:
        """The compute-domain member annotation of the Node (None: not a member)."""
        _, body = self.server.request("GET", f"/api/v1/nodes/{node}")
        raw = body["metadata"].get("annotations", {}).get(MEMBER_ANNOTATION)
        return dict(json.loads(raw)) if raw else None

    def unfit_event(self, job: Job) -> Json | None:
        """The Warning Event the explaining plugin gave the job's domain claim, if any."""
        status, body = self.server.request(
            "GET", f"/api/v1/namespaces/{job.namespace}/events?fieldSelector="
                   f"involvedObject.name%3D{job.claim},reason%3DComputeDomainUnfit")
        assert status == 200, body
        items = body.get("items") or []
        return dict(items[-1]) if items else None

    def lose(self, node: str) -> None:
        """The node is lost: its agent, plugin and kubelet gone, and its Node marked as the
        node lifecycle controller marks an unreachable node (Ready Unknown, the unreachable
        taint), so nothing is scheduled there any more."""
        self.stacks[node].close()
        self.server.kubectl(
            "patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(
                {"status": {"conditions": [{
                    "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                    "message": "Kubelet stopped posting node status."}]}}))
        self.server.kubectl("taint", "node", node, "node.kubernetes.io/unreachable:NoSchedule")

    def domain_view(self, node: str, uid: str) -> Json | None:
        """The node's agent's ``GET /v1/domains/{uid}`` (None: it has no such domain)."""
        reply = self.stacks[node].agent.request("GET", f"/v1/domains/{uid}")
        if reply.status == 404:
            return None
        assert reply.status == 200, reply.body
        return dict(reply.body)

    def api_writes(self) -> Counter[str]:
        """The API server's write requests so far, by resource (its own metrics)."""
        context = ssl.create_default_context(cafile=str(self.server.ca))
        request = urllib.request.Request(f"{self.server.url}/metrics", headers={
            "Authorization": f"Bearer {self.server.token}"})
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            text = response.read().decode()
        writes: Counter[str] = Counter()
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("verb") in ("POST", "PUT", "PATCH", "DELETE", "APPLY"):
                resource = labels.get("resource", "")
                if labels.get("subresource"):
                    resource += "/" + labels["subresource"]
                writes[resource] += int(float(line.rsplit(" ", 1)[1]))
        return writes


def _gpus_template(name: str) -> Json:
    """A claim template for all four GPUs of a node (one pod a node)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": GPU_CLASS, "allocationMode": "ExactCount",
                "count": 4}}]}}}}


def _pod(pod: str, job: str, claim: str, template: str) -> Json:
    """A pod of ``job``: the domain claim and a GPU claim from ``template``."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "labels": {"job": job}},
            "spec": {"restartPolicy": "Never",
                     "resourceClaims": [{"name": "domain", "resourceClaimName": claim},
                                        {"name": "gpus", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "worker", "image": "registry.invalid/worker",
                                     "resources": {"claims": [{"name": "domain"},
                                                              {"name": "gpus"}]}}]}}


#: Every plugin takes part in electing the explainer of unplaceable domains, on a short
#: Lease and a short round (the defaults: 60 s and 30 s).
EXPLAINING = ("--lease-namespace", PLUGIN_NAMESPACE, "--lease-duration", "8",
              "--domain-explain-interval", "1")


def node_name(clique: int, index: int) -> str:
    return f"nvl72-{'ab'[clique]}-{index:02d}"


def start_bed(root: Path, size: BedSize) -> Iterator[DomainBed]:
    """The bed (a generator: the bed, then everything stopped)."""
    server = ApiServer.start(NEWEST, root / "apiserver")
    stacks = stack_factory()
    start = next(stacks)
    scheduler: KubeScheduler | None = None

    def close() -> None:
        if scheduler is not None:
            scheduler.close()
        next(stacks, None)
        server.stop()

    try:
        apply_shipped(server, DEVICE_CLASSES)
        plan = [(node_name(c, i), c) for c, count in enumerate((size.first, size.second))
                for i in range(count)]
        addresses = {name: f"127.0.{ADDRESS_BLOCK}.{n + 1}" for n, (name, _) in enumerate(plan)}
        for name, _ in plan:
            schedulable_node(server, name)
        # The shipped RBAC, policy and account made once, before the nodes start together
        # (each start applies them again, which is then a no-op, not a create race).
        plugin_kubeconfig(server, plan[0][0], root / "first.kubeconfig")

        def one(name: str, clique: int) -> Stack:
            return start(server, "gb200-nvl72", node=name, agent_extra=(
                "--sim-cluster-uuid", RACKS[clique], "--sim-clique-id", "1",
                "--imex-address", addresses[name]), plugin_extra=EXPLAINING)

        with ThreadPoolExecutor(8) as pool:
            started = dict(zip([n for n, _ in plan],
                               pool.map(lambda p: one(*p), plan), strict=True))
        for stack in started.values():
            stack.wait_current()
        scheduler = KubeScheduler(server, root=root / "scheduler")
        cliques = {name: f"{RACKS[c]}.1" for name, c in plan}
        bed = DomainBed(server, scheduler, started, cliques, addresses, close)
    except BaseException:
        close()
        raise
    try:
        yield bed
    finally:
        bed.close()


def nodes_of(job_nodes: dict[str, str]) -> list[str]:
    return sorted(set(job_nodes.values()))


def imex_nodes_config(stack: Stack) -> list[str]:
    """The node list the agent wrote for its IMEX daemon (one seat's name a line)."""
    path = stack.agent_dir / "imex" / "nodes_config.cfg"
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def imex_seats(stack: Stack, pid: int) -> list[str | None]:
    """The node list as the IMEX daemon ``pid`` resolves it: each name of its node list
    through the /etc/hosts of its own mount namespace (None: no address for that seat)."""
    hosts: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/root/etc/hosts").read_text().splitlines():
        address, *names = line.split("#")[0].split() or [""]
        for name in names:
            hosts.setdefault(name, address)
    return [hosts.get(name) for name in imex_nodes_config(stack)]


def dumps(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True)[:4000]
