"""The Kubernetes manifests (deploy/kubernetes/), validated offline.

Built-in kinds go through kubernetes-validate's strict schemas (unknown fields
fail); the Prometheus Operator's kinds get structural checks.  The manifests are
also checked against each other and against the code: the DaemonSet's and the
example Job's command lines parse with the real parsers, the Service, the
ServiceMonitor and the pods agree on names and ports, and the generated
PrometheusRule and dashboards match dashboards/.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rankwatch.agent.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
DASHBOARDS = REPO / "dashboards"
EXAMPLE = K8S / "examples" / "training-job.yaml"
ETCD_EXAMPLE = K8S / "examples" / "training-job-etcd.yaml"   # survives any node
GENERATE = K8S / "generate.py"
# The oldest Kubernetes still commonly run (EKS/GKE extended support) and the newest
# the validator ships.
K8S_VERSIONS = ("1.29.0", "1.37.0")
OPERATOR_API = "monitoring.coreos.com/v1"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _base() -> list[dict[str, Any]]:
    """Every object the kustomization deploys."""
    return [d for f in _kustomization()["resources"] for d in _docs(K8S / f)]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _container(pod_spec: dict[str, Any], name: str, key: str = "containers") -> dict[str, Any]:
    return next(c for c in pod_spec[key] if c["name"] == name)


def _daemonset() -> dict[str, Any]:
    return _one(_base(), "DaemonSet", "rankwatch-agent")


def _agent_args(node: str = "gpu-node-7") -> list[str]:
    agent = _container(_daemonset()["spec"]["template"]["spec"], "agent")
    assert agent["command"] == ["rankwatch"]
    return [a.replace("$(NODE_NAME)", node) for a in agent["args"]]


def _host_path(pod_spec: dict[str, Any], container: dict[str, Any], mount_path: str) -> str:
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    return volume["hostPath"]["path"]


# -- kustomize ----------------------------------------------------------------------------

def test_kustomization_lists_every_manifest_and_only_manifests():
    k = _kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    listed = k["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "kustomization.yaml must list exactly the manifests here"
    seen = set()
    for name in listed:
        docs = _docs(K8S / name)
        assert docs, f"{name} holds no object"
        for d in docs:
            assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"{name}: not a manifest: {d}"
            key = (d["kind"], d["metadata"]["name"])
            assert key not in seen, f"{key} defined twice"
            seen.add(key)
            assert "namespace" not in d["metadata"], f"{key}: the kustomization sets the namespace"
    assert ("Namespace", k["namespace"]) in seen


# -- built-in kinds: strict schemas -------------------------------------------------------

def _builtin(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["apiVersion"] != OPERATOR_API]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_pass_strict_schema_validation(version):
    docs = _builtin(_base()) + _docs(EXAMPLE) + _docs(ETCD_EXAMPLE)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "DaemonSet", "Service", "ConfigMap", "Job",
            "PersistentVolumeClaim"} <= kinds
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} on Kubernetes {version}: "
                        f"{exc.message} at {'.'.join(map(str, exc.path))}")


def test_strict_validation_refuses_a_misspelt_field():
    ds = copy.deepcopy(_daemonset())
    ds["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)


# -- the agent DaemonSet ------------------------------------------------------------------

def test_daemonset_args_parse_with_the_agent_cli():
    args = build_parser().parse_args(_agent_args("gpu-node-7"))
    assert args.command == "agent" and args.node_id == "gpu-node-7"
    assert [str(a) for a in args.listen] == ["unix:/run/rankwatch/agent.sock", "$(POD_IP):7411"]
    pod = _daemonset()["spec"]["template"]["spec"]
    agent = _container(pod, "agent")
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["RANKWATCH_AGENT"]["value"] == "/run/rankwatch/agent.sock"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert args.metrics_port == ports["metrics"] == 9478
    assert _host_path(pod, agent, "/run/rankwatch") == "/run/rankwatch"
    assert _host_path(pod, agent, str(args.state_dir)) == "/var/lib/rankwatch"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert ports["grpc-tls"] == 7411
    # Mutual TLS from the node's own certificate: the init container writes every file the
    # flags name into a memory-backed volume the agent mounts read-only.
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == "/etc/rankwatch/tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and mount["readOnly"] is True
    assert [args.tls_cert, args.tls_key, args.tls_ca] == [
        Path("/etc/rankwatch/tls") / k for k in ("tls.crt", "tls.key", "ca.crt")]
    # The job CA's Secret (its key) reaches the init container alone.
    ca = next(v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "rankwatch-ca")
    holders = [c["name"] for c in (*pod["initContainers"], *pod["containers"])
               if any(m["name"] == ca for m in c["volumeMounts"])]
    assert holders == ["node-certificate"]


def test_the_init_container_issues_the_nodes_certificate_and_the_agent_serves_with_it(tmp_path):
    """The init container's script, run as written (its mount paths moved under tmp_path),
    against a CA Secret laid out as cert-manager writes it and the kubelet mounts it
    (tls.crt, tls.key group-readable); then a real agent with the DaemonSet's TLS flags
    serves mutual TLS on loopback, and its certificate names the node."""
    import os

    from rankwatch.address import Address
    from rankwatch.status import AgentUnreachable, fetch_status
    from tlscerts import CertAuthority, certs

    pod = _daemonset()["spec"]["template"]["spec"]
    init = _container(pod, "node-certificate", "initContainers")
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in init["volumeMounts"]}
    script = init["args"][0]
    for path, there in mounts.items():
        there.mkdir()
        script = script.replace(path, str(there))
    ca = CertAuthority(tmp_path, "made")   # cert-manager's Secret: tls.crt and tls.key
    secret = mounts["/etc/rankwatch/job-ca"]
    (secret / "tls.crt").write_bytes(ca.ca.read_bytes())
    (secret / "tls.key").write_bytes((ca.root / "ca.key").read_bytes())
    (secret / "tls.key").chmod(0o440)   # defaultMode 0400, group-readable through fsGroup
    env = {**os.environ, "NODE_NAME": "gpu-node-7", "POD_IP": "127.0.0.1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(init["command"] + [script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tls = mounts["/etc/rankwatch/tls"]
    assert sorted(p.name for p in tls.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert (tls / "tls.key").stat().st_mode & 0o777 == 0o600
    assert not (mounts["/run/rankwatch-ca"] / "ca.key").exists(), "the CA key copy outlived its use"
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tls / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "urn:rankwatch:node:gpu-node-7" in sans.get_values_for_type(x509.UniformResourceIdentifier)

    # The agent, with the DaemonSet's TLS flags (paths moved), serves a client of the same CA.
    port = _free_port()
    flags = [a.replace("/etc/rankwatch/tls", str(tls)) for a in _agent_args("gpu-node-7")]
    tls_flags = flags[flags.index("--tls-cert"):flags.index("--tls-ca") + 2]
    from conftest import AgentProcess

    agent = AgentProcess(tmp_path / "a.sock", "gpu-node-7",
                         extra=("--listen", f"127.0.0.1:{port}", *tls_flags)).start()
    try:
        assert certs("issue", str(ca.root), "--client", "ops").returncode == 0
        client = {"RANKWATCH_TLS_CA": str(tls / "ca.crt"), "RANKWATCH_TLS_CERT": str(ca.root / "ops.crt"),
                  "RANKWATCH_TLS_KEY": str(ca.root / "ops.key")}
        os.environ.update(client)
        try:
            assert fetch_status(Address.parse(f"127.0.0.1:{port}"))["node"] == "gpu-node-7"
        finally:
            for k in client:
                del os.environ[k]
        with pytest.raises(AgentUnreachable):   # no client certificate: no handshake
            fetch_status(Address.parse(f"127.0.0.1:{port}"))
    finally:
        agent.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemonset_runs_unprivileged_on_gpu_nodes():
    spec = _daemonset()["spec"]
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^USER {ctx['runAsUser']}$", dockerfile, re.M), "runAsUser is not the image's user"

    agent = _container(pod, "agent")
    assert agent["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert not any("nvidia.com/gpu" in r for r in agent["resources"].values()), "the agent takes no GPU"
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}

    init, issuer = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    # The certificate's issuer runs as the agent's user, with nothing added.
    assert issuer["name"] == "node-certificate" and "runAsUser" not in issuer["securityContext"]
    assert issuer["securityContext"] == agent["securityContext"]
    for c in (agent, init, issuer):
        assert {"requests", "limits"} <= c["resources"].keys(), f"{c['name']} has no resources"
        assert "privileged" not in c["securityContext"]


# -- Service, ServiceMonitor, PrometheusRule ----------------------------------------------

def test_service_and_servicemonitor_reach_the_agents_metrics_port():
    docs = _base()
    svc, mon, ds = _one(docs, "Service"), _one(docs, "ServiceMonitor"), _daemonset()
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    agent = _container(ds["spec"]["template"]["spec"], "agent")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port == {"name": "metrics", "port": 9478, "targetPort": "metrics", "protocol": "TCP"}
    assert any(p["name"] == "metrics" for p in agent["ports"])
    # The alerts watch up{job=~"rankwatch.*"}; the operator names the job after the Service.
    assert svc["metadata"]["name"].startswith("rankwatch")

    assert mon["apiVersion"] == OPERATOR_API and mon["metadata"]["name"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"], "a ServiceMonitor needs endpoints"
    for ep in mon["spec"]["endpoints"]:
        assert ep["port"] == "metrics" and ep["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", ep["interval"]) and re.fullmatch(r"\d+[smh]", ep["scrapeTimeout"])


def test_prometheusrule_is_alerts_yml():
    rule = _one(_base(), "PrometheusRule")
    assert rule["apiVersion"] == OPERATOR_API and rule["metadata"]["name"]
    alerts = yaml.safe_load((DASHBOARDS / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    for group in rule["spec"]["groups"]:
        assert isinstance(group["name"], str) and group["rules"], group.get("name")
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r), r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert "for" not in r or re.fullmatch(r"(\d+[smhdwy])+", r["for"]), r
            for field in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in r.get(field, {}).values()), r


def test_grafana_configmaps_carry_every_dashboard():
    maps = [d for d in _base() if d["kind"] == "ConfigMap"]
    by_name = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (key, text), = cm["data"].items()
        assert key.endswith(".json")
        by_name[key] = json.loads(text)
        # kubectl's client-side apply keeps a copy in an annotation, capped at 256 KiB.
        assert len(text.encode()) < 256 * 1024, f"{key} is too large for kubectl apply"
    sources = sorted((DASHBOARDS / "grafana").glob("*.json"))
    assert sources, "no dashboards in dashboards/grafana"
    assert sorted(json.dumps(d, sort_keys=True) for d in by_name.values()) == sorted(
        json.dumps(json.loads(p.read_text()), sort_keys=True) for p in sources)


# -- generate.py --------------------------------------------------------------------------

def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True,
                          timeout=60)


def test_generated_manifests_are_fresh():
    r = _generate("--check")
    assert r.returncode == 0, r.stderr


def _tiny_source(root: Path) -> Path:
    (root / "prometheus").mkdir(parents=True)
    (root / "grafana").mkdir()
    (root / "prometheus" / "alerts.yml").write_text(
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: |\n"
        "          up == 0\n        for: 1m\n        labels: {severity: page}\n")
    (root / "grafana" / "My Board.json").write_text('{"title": "b", "panels": []}\n')
    return root


def test_generator_writes_checks_and_refuses_bad_input(tmp_path):
    src, out = _tiny_source(tmp_path / "src"), tmp_path / "out"
    out.mkdir()
    assert _generate("--source", str(src), "--out", str(out), "--check").returncode == 1
    assert _generate("--source", str(src), "--out", str(out)).returncode == 0
    assert _generate("--source", str(src), "--out", str(out), "--check").returncode == 0

    (rule,) = _docs(out / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == [
        {"name": "g", "rules": [{"alert": "A", "expr": "up == 0\n", "for": "1m",
                                 "labels": {"severity": "page"}}]}]
    (cm,) = _docs(out / "grafana-dashboards.yaml")
    assert cm["metadata"]["name"] == "rankwatch-dashboard-my-board"
    assert json.loads(cm["data"]["rankwatch-dashboard-my-board.json"]) == {"title": "b", "panels": []}

    before = (out / "prometheusrule.yaml").read_text()
    (src / "prometheus" / "alerts.yml").write_text(
        (src / "prometheus" / "alerts.yml").read_text().replace("up == 0", "up < 1"))
    r = _generate("--source", str(src), "--out", str(out), "--check")
    assert r.returncode == 1 and "stale: prometheusrule.yaml" in r.stderr
    assert (out / "prometheusrule.yaml").read_text() == before, "--check must not write"

    (src / "grafana" / "broken.json").write_text("{")
    r = _generate("--source", str(src), "--out", str(out))
    assert r.returncode == 2 and "broken.json is not JSON" in r.stderr and "Traceback" not in r.stderr
    (src / "prometheus" / "alerts.yml").write_text("rules: []\n")
    r = _generate("--source", str(src), "--out", str(out))
    assert r.returncode == 2 and "has no `groups:` list" in r.stderr


# -- the example training Job -------------------------------------------------------------

def test_training_job_example_reaches_the_agent_and_its_command_parses():
    docs = _docs(EXAMPLE)
    job, svc = _one(docs, "Job"), _one(docs, "Service")
    pod = job["spec"]["template"]["spec"]
    train = _container(pod, "train")
    env = {e["name"]: e for e in train["env"]}

    # The agent's socket: same host directory, same path.
    ds_pod = _daemonset()["spec"]["template"]["spec"]
    agent_listen = build_parser().parse_args(_agent_args()).listen[0].path
    assert env["RANKWATCH_AGENT"]["value"] == agent_listen
    sock_dir = str(Path(agent_listen).parent)
    assert _host_path(pod, train, sock_dir) == _host_path(ds_pod, _container(ds_pod, "agent"), sock_dir)
    assert pod["securityContext"]["runAsUser"] == ds_pod["securityContext"]["runAsUser"], \
        "the socket is 0600: training runs as the agent's uid"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    # rankwatch run -> torchrun -> the harness, each with its real parser.
    assert train["command"] == ["rankwatch"]
    run = build_parser().parse_args([a.replace("$(NODE_NAME)", "gpu-node-7") for a in train["args"]])
    assert run.command == "run" and run.node_id == "gpu-node-7"
    torchrun_args = run.torchrun_args[1:] if run.torchrun_args[0] == "--" else run.torchrun_args
    from torch.distributed.run import get_args_parser

    from rankwatch.hooks.train import parse_args as harness_args

    tr = get_args_parser().parse_args(torchrun_args)
    assert tr.module and tr.training_script == "rankwatch.hooks.train"
    harness = harness_args(tr.training_script_args)

    # Shape: one pod per node, one rank per GPU, rendezvous at pod 0 through the Service.
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(tr.nnodes)
    assert int(tr.nproc_per_node) == train["resources"]["limits"]["nvidia.com/gpu"]
    assert (int(tr.nnodes) * int(tr.nproc_per_node)) % harness.tp == 0
    name = job["metadata"]["name"]
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert tr.rdzv_endpoint.rsplit(":", 1) == [f"{name}-0.{svc['metadata']['name']}",
                                               str(svc["spec"]["ports"][0]["port"])]
    mounts = {m["mountPath"] for m in train["volumeMounts"]}
    assert str(harness.checkpoint_dir) in mounts



def test_etcd_example_wires_a_per_job_agent_elected_in_etcd_to_the_training_container():
    from torch.distributed.run import get_args_parser

    from rankwatch.agent.link.election import parse_endpoints
    from rankwatch.agent.cli.torchrun_args import plan

    pod = _one(_docs(ETCD_EXAMPLE), "Job")["spec"]["template"]["spec"]
    sidecar, train = _container(pod, "job-agent", "initContainers"), _container(pod, "train")
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: it stops with the pod, the Job completes"

    def expand(args: list[str]) -> list[str]:
        return [a.replace("$(POD_NAME)", "rankwatch-train-etcd-0-abcde").replace("$(POD_IP)", "10.1.2.3")
                for a in args]

    agent = build_parser().parse_args(expand(sidecar["args"]))
    run = build_parser().parse_args(expand(train["args"]))
    tr = get_args_parser().parse_args(run.torchrun_args[1:] if run.torchrun_args[0] == "--" else run.torchrun_args)

    # The ranks reach the sidecar's socket through a volume both containers mount.
    (sock,) = [a.path for a in agent.listen if a.path is not None]
    env = {e["name"]: e for e in train["env"]}
    assert env["RANKWATCH_AGENT"]["value"] == sock
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, train)]
    sock_dir = str(Path(sock).parent)
    assert mounts[0][sock_dir] == mounts[1][sock_dir]
    assert agent.state_dir is not None and str(agent.state_dir).startswith(sock_dir), \
        "the state directory must be on a writable volume (the root file system is read-only)"
    # One node id for the agent and for rankwatch run; one etcd and one id for seat and rendezvous.
    assert agent.node_id == run.node_id
    host, port = tr.rdzv_endpoint.split(":")
    assert parse_endpoints(agent.election) == [(host, int(port))]
    assert agent.job_id == tr.rdzv_id
    assert tr.rdzv_backend == "etcd-v2" and tr.module and tr.training_script == "rankwatch.hooks.train"
    launched = plan(run.torchrun_args[1:], {}).args
    assert launched[launched.index("--rdzv-backend") + 1] == "rankwatch-etcd"
    assert int(tr.nnodes.split(":")[0]) == agent.min_nodes


def test_the_cert_manager_example_makes_the_ca_secret_the_daemonset_mounts():
    docs = _docs(K8S / "examples" / "cert-manager-ca.yaml")
    issuer, cert = _one(docs, "Issuer"), _one(docs, "Certificate")
    assert issuer["spec"] == {"selfSigned": {}} and cert["spec"]["isCA"] is True
    assert cert["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                         "group": "cert-manager.io"}
    assert {d["metadata"]["namespace"] for d in docs} == {_kustomization()["namespace"]}
    pod = _daemonset()["spec"]["template"]["spec"]
    assert cert["spec"]["secretName"] in [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    # cert-manager writes tls.crt and tls.key: the init container reads those names.
    script = _container(pod, "node-certificate", "initContainers")["args"][0]
    assert "/etc/rankwatch/job-ca/tls.crt" in script and "/etc/rankwatch/job-ca/tls.key" in script
