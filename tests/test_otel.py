"""OpenTelemetry export against real OTLP endpoints on loopback (gRPC and HTTP/protobuf).

The endpoints are the OTLP collector services from ``opentelemetry-proto``'s generated code,
started by the tests; the agent's exporter is the stock OTLP exporter it ships with.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from conftest import AgentProcess, torchrun, wait_for
from rankwatch.agent.export import otel
from rankwatch.address import Address
from rankwatch.agent.gpu import GpuConfig
from rankwatch.agent.gpu.script import load_script
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb

# Its e2e tests mostly wait on timers: they may run beside another light file (tests/cores.py).
pytestmark = pytest.mark.light

OTEL_VARS = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
             "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
             otel.STEP_SAMPLE_ENV)


# -- a real OTLP endpoint ---------------------------------------------------------------------

class OtlpSink:
    """An OTLP receiver on 127.0.0.1: gRPC TraceService and MetricsService, or HTTP POST /v1/traces."""

    def __init__(self, protocol: str = "grpc") -> None:
        self.protocol = protocol
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self.port = 0

    def start(self) -> OtlpSink:
        if self.protocol == "grpc":
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Receiver(self), self._server)
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsReceiver(self), self._server)
            self.port = self._server.add_insecure_port("127.0.0.1:0")
            self._server.start()
        else:
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(self))
            self.port = self._server.server_port
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.protocol == "grpc":
            self._server.stop(0).wait()
        else:
            self._server.shutdown()
            self._server.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def take_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self._lock:
            self.metric_requests.append(request)

    def points(self) -> dict[tuple[str, frozenset], tuple[float, str, dict[str, Any]]]:
        """The latest value of every metric stream: (name, attributes) -> (value, unit, resource)."""
        with self._lock:
            requests = list(self.metric_requests)
        out = {}
        for req in requests:
            for rm in req.resource_metrics:
                resource = _attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        for p in getattr(m, m.WhichOneof("data")).data_points:
                            value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            attrs = frozenset(_attributes(p.attributes).items())
                            out[(m.name, attrs)] = (value, m.unit, resource)
        return out

    def spans(self) -> list[dict[str, Any]]:
        """Every span received, flattened, with its resource's attributes."""
        with self._lock:
            requests = list(self.requests)
        out = []
        for req in requests:
            for rs in req.resource_spans:
                resource = _attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append({"name": s.name, "trace_id": int.from_bytes(s.trace_id, "big"),
                                    "parent": s.parent_span_id, "start": s.start_time_unix_nano / 1e9,
                                    "end": s.end_time_unix_nano / 1e9, "attrs": _attributes(s.attributes),
                                    "status": s.status.code, "resource": resource, "scope": ss.scope.name})
        return out


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 - the generated service's name
        self.sink.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 - the generated service's name
        self.sink.take_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _http_handler(sink: OtlpSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            sink.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def thread_agent(tmp_path: Path, node: str = "n0", gpu: GpuConfig | None = None) -> Agent:
    agent = Agent(AgentConfig(node_id=node, listen=[Address(path=str(tmp_path / "a.sock"))],
                              metrics_port=None, gpu=gpu or GpuConfig(source="none")))
    agent.start()
    return agent


def otel_listeners(agent: Agent) -> list:
    """The agent's step and incident listeners that belong to span export."""
    return [f for f in agent.state.step_listeners + agent.incidents.listeners
            if isinstance(getattr(f, "__self__", None), otel.SpanExport)]


def rank_client(addr: Address, rank: int, job_id: str) -> tuple[Recorder, AgentClient]:
    rec = Recorder(capacity=1 << 12)
    hello = pb.Hello(rank=rank, world_size=4, pid=os.getpid(), node_id="n0", backend="gloo",
                     op_names=list(OPS), job_id=job_id, mesh_coords={"dp": rank // 2, "tp": rank % 2},
                     mesh_shape={"dp": 2, "tp": 2})
    return rec, AgentClient(rec, hello, addr, flush_interval=timedelta(milliseconds=20))


# -- unit: configuration ----------------------------------------------------------------------

def test_step_sampling_parses_and_picks() -> None:
    assert otel.StepSampling.parse("") == otel.StepSampling()
    s = otel.StepSampling.parse("every=5, slower=3")
    assert (s.every, s.slower) == (5, 3.0)
    steps, durations = list(range(1, 13)), [0.1] * 12
    durations[6] = 0.5                                  # step 7: 5x the median
    assert s.pick(steps, durations, median=0.1) == [(4, False), (6, True), (9, False)]
    assert s.pick(steps, durations, median=0.0) == [(4, False), (9, False)]  # no history: periodic only
    assert otel.StepSampling.parse("every=0,slower=0").pick(steps, durations, 0.1) == []
    for bad, match in (("each=3", "unknown key"), ("every=x", "not a number"),
                       ("slower=0.5", "slower=0.5"), ("every=-1", "every=-1")):
        with pytest.raises(ValueError, match=match):
            otel.StepSampling.parse(bad)


def test_exporters_follow_standard_env(clean_env: pytest.MonkeyPatch) -> None:
    def chosen(signal: str) -> list[str]:  # e.g. ["grpc.OTLPSpanExporter", "ConsoleSpanExporter"]
        return [f"{type(e).__module__.split('.')[4]}.{type(e).__name__}"
                if ".otlp.proto." in type(e).__module__ else type(e).__name__ for e in otel.exporters(signal)]

    assert otel.exporters("traces") == [] and otel.exporters("metrics") == []
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert chosen("traces") == ["grpc.OTLPSpanExporter"] and chosen("metrics") == ["grpc.OTLPMetricExporter"]
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    assert chosen("traces") == ["http.OTLPSpanExporter"] and chosen("metrics") == ["grpc.OTLPMetricExporter"]
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "console")
    assert chosen("traces") == [] and chosen("metrics") == ["ConsoleMetricExporter"]
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    assert chosen("traces") == ["http.OTLPSpanExporter", "ConsoleSpanExporter"]
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert otel.exporters("traces") == [] and otel.exporters("metrics") == []
    clean_env.delenv("OTEL_SDK_DISABLED")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        otel.exporters("traces")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'"):
        otel.exporters("traces")


# -- the agent without OpenTelemetry ----------------------------------------------------------

def test_no_otel_env_agent_runs_and_exports_nothing(clean_env, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rankwatch.agent.export.otel")
    agent = thread_agent(tmp_path)
    try:
        assert agent._otel is None
        assert not otel_listeners(agent)
        rec, client = rank_client(agent.config.listen[0], 0, "job-a")
        client.start()
        for n in range(1, 11):
            with rec.step_scope(n):
                rec.mark("forward")
        wait_for(lambda: agent.state.records["step"] == 10, 10, what="steps at the agent")
        client.close(timedelta(seconds=0.5))
        agent.incidents.add(kind="straggler", node="n0", rank=0, step=10, detected_at=time.time(),
                            detail={"cause": "compute", "slowdown": 1.5})
    finally:
        agent.stop(timedelta(seconds=0.5))
    off = [r for r in caplog.records if "OpenTelemetry export off" in r.getMessage()]
    assert len(off) == 1 and "OTEL_EXPORTER_OTLP_ENDPOINT" in off[0].getMessage()


def test_missing_exporter_package_logs_once_and_agent_runs(clean_env, tmp_path, caplog) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    # An import of a module whose sys.modules entry is None raises ImportError: the package
    # is as good as absent.
    for kind in ("trace", "metric"):
        clean_env.setitem(sys.modules, f"opentelemetry.exporter.otlp.proto.grpc.{kind}_exporter", None)
    agent = thread_agent(tmp_path)
    try:
        assert agent._otel is None and not otel_listeners(agent)
        warned = [r.getMessage() for r in caplog.records if r.name == "rankwatch.agent.export.otel"]
        assert len(warned) == 1 and "pip install 'rankwatch[otlp]'" in warned[0], warned
    finally:
        agent.stop(timedelta(seconds=0.5))


# -- HTTP/protobuf, a real rank client, the agent in a thread ---------------------------------

def test_http_protobuf_steps_and_checkpoint_spans(clean_env, tmp_path) -> None:
    sink = OtlpSink("http/protobuf").start()
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{sink.endpoint}/v1/traces")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    clean_env.setenv(otel.STEP_SAMPLE_ENV, "every=5,slower=4")
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,host.name=box7")
    agent = thread_agent(tmp_path, node="n3")
    try:
        assert agent._otel is not None and len(otel_listeners(agent)) == 2
        rec, client = rank_client(agent.config.listen[0], 3, "job-b")
        client.start()
        t0 = time.time()
        for n in range(1, 21):
            with rec.step_scope(n, tokens=64):
                time.sleep(0.25 if n == 13 else 0.01)
                rec.mark("forward")
        wait_for(lambda: agent.state.records["step"] == 20, 10, what="steps at the agent")
        client.close(timedelta(seconds=0.5))
        t1 = time.time()
        agent.incidents.add(kind="checkpoint", node="n3", rank=3, step=20, detected_at=t1,
                            detail={"started_at": t1 - 1.5, "path": "/ckpt/step-20", "ok": True,
                                    "bytes": 123, "ranks": [0, 1]})
    finally:
        agent.stop(timedelta(seconds=0.5))  # flushes: every span is at the sink afterwards
    sink.stop()
    spans = sink.spans()
    steps = {s["attrs"]["rankwatch.step"]: s for s in spans if s["name"] == "rankwatch.step"}
    assert {5, 10, 13, 15, 20} <= steps.keys(), sorted(steps)
    slow = steps[13]
    assert slow["attrs"]["rankwatch.step.sampled"] == "slow" and slow["attrs"]["rankwatch.step.slowdown"] > 4
    assert steps[10]["attrs"]["rankwatch.step.sampled"] == "periodic"
    for n, s in steps.items():
        a = s["attrs"]
        assert (a["rankwatch.rank"], a["rankwatch.node"], a["rankwatch.job_id"]) == (3, "n3", "job-b")
        assert (a["rankwatch.mesh.dp"], a["rankwatch.mesh.tp"], a["process.pid"]) == (1, 1, os.getpid())
        assert a["rankwatch.step.tokens"] == 64 and a["rankwatch.step.forward_seconds"] > 0
        assert t0 <= s["start"] < s["end"] <= t1 and s["trace_id"] == otel.step_trace_id("job-b", n)
        assert s["parent"] == b""
    assert 0.24 <= slow["end"] - slow["start"] < 1.0
    (ckpt,) = [s for s in spans if s["name"] == "rankwatch.checkpoint"]
    assert ckpt["start"] == pytest.approx(t1 - 1.5, abs=1e-6) and ckpt["end"] == pytest.approx(t1, abs=1e-6)
    a = ckpt["attrs"]
    assert a["rankwatch.incident.kind"] == "checkpoint" and a["rankwatch.incident.detail.path"] == "/ckpt/step-20"
    assert a["rankwatch.incident.detail.bytes"] == 123 and a["rankwatch.incident.detail.ok"] is True
    assert json.loads(a["rankwatch.incident.detail"])["ranks"] == [0, 1]
    assert a["rankwatch.mesh.dp"] == 1 and ckpt["trace_id"] == steps[20]["trace_id"]
    resource = ckpt["resource"]
    assert resource["service.name"] == "rankwatch-agent" and resource["rankwatch.node"] == "n3"
    assert resource["deployment.environment"] == "test" and resource["host.name"] == "box7"


# -- GPU metrics over OTLP/gRPC, from the scripted GPU source ---------------------------------

def test_gpu_metrics_follow_hardware_conventions(clean_env, tmp_path) -> None:
    sink = OtlpSink("grpc").start()
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
    clean_env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    script = tmp_path / "gpus.json"
    script.write_text(json.dumps({"gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 2}, "events": [
        {"at": 0.1, "gpu": 1, "ecc": {"corrected": 3}, "nvlink": {"1": {"crc_flit": 4}}},
        {"at": 0.3, "gpu": 1, "xid": 79, "lost": True}]}))
    agent = thread_agent(tmp_path, gpu=GpuConfig(source="script", script=load_script(script),
                                                  interval=timedelta(seconds=0.1)))
    try:
        gpu0 = wait_for(lambda: [r for r in agent.gpu.readings() if r.index == 0], 10, what="GPU readings")[0]
        uuid1 = next(r.uuid for r in agent.gpu.readings() if r.index == 1)

        def point(name: str, uuid: str, **extra: str) -> float | None:
            index = "0" if uuid == gpu0.uuid else "1"
            attrs = frozenset({"hw.type": "gpu", "hw.id": uuid, "hw.name": "NVIDIA H100 80GB HBM3",
                               "rankwatch.gpu": index, **extra}.items())
            return sink.points().get((name, attrs), (None,))[0]

        wait_for(lambda: point("hw.status", uuid1, **{"hw.state": "failed"}) == 1
                 and point("hw.errors", uuid1, **{"error.type": "xid_79"}) == 1, 10, what="GPU 1 lost, XID 79")
        assert point("hw.status", uuid1, **{"hw.state": "ok"}) == 0
        assert point("hw.errors", uuid1, **{"error.type": "ecc_corrected"}) == 3
        assert point("hw.errors", uuid1, **{"error.type": "nvlink_crc_flit"}) == 4
        assert point("hw.status", gpu0.uuid, **{"hw.state": "ok"}) == 1
        assert point("hw.gpu.utilization", gpu0.uuid, **{"hw.gpu.task": "general"}) == pytest.approx(
            gpu0.utilization_ratio)
        assert point("hw.gpu.memory.limit", gpu0.uuid) == gpu0.memory_total_bytes
        assert point("hw.temperature", gpu0.uuid) == pytest.approx(gpu0.temperature_celsius)
        assert point("hw.power", gpu0.uuid) == pytest.approx(gpu0.power_watts)
        units = {name: unit for (name, _), (_, unit, _) in sink.points().items()}
        assert units["hw.temperature"] == "Cel" and units["hw.gpu.memory.usage"] == "By"
        resource = next(iter(sink.points().values()))[2]
        assert resource["rankwatch.node"] == "n0" and resource["service.name"] == "rankwatch-agent"
        # The XID is a gpu_fault incident, and so an ERROR span.
        (fault,) = wait_for(lambda: [s for s in sink.spans() if s["name"] == "rankwatch.gpu_fault"
                                     and s["attrs"].get("rankwatch.incident.detail.xid") == 79], 10,
                            what="gpu_fault span of XID 79")
        assert fault["status"] == 2 and fault["attrs"]["rankwatch.incident.detail.action"] == "reboot"
    finally:
        agent.stop(timedelta(seconds=0.5))
        sink.stop()


# -- gRPC, a real torchrun job, the agent as a process ----------------------------------------

@pytest.mark.e2e
def test_torchrun_job_steps_and_hang_reach_otlp_grpc(tmp_path) -> None:
    sink = OtlpSink("grpc").start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "rankwatch-e2e",
           "OTEL_BSP_SCHEDULE_DELAY": "200", otel.STEP_SAMPLE_ENV: "every=5,slower=3"}
    agent = AgentProcess(tmp_path / "agent.sock", env=env, extra=("--hang-floor", "3")).start()
    t0 = time.time()
    job = torchrun(2, "--steps", "20", "--dp", "2", "--log-every", "0", "--fault", "sleep_forward:1:12:5",
                   "--metrics-out", str(tmp_path / "out"), agent=agent.addr, log=tmp_path / "job.log")
    try:
        assert job.wait(120) == 0, (tmp_path / "job.log").read_text()[-3000:]
        t1 = time.time()
        # Spans arrive while the agent runs (a 200 ms batch delay), not only at its exit.
        wait_for(lambda: {s["attrs"]["rankwatch.step"] for s in sink.spans()
                          if s["name"] == "rankwatch.step"} >= {5, 10, 15, 20}, 10, what="step spans")
        hangs = [i for i in agent.status()["incidents"] if i["kind"] == "hang"]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        agent.stop()
        sink.stop()
    assert len(hangs) == 1 and hangs[0]["rank"] == 1, hangs
    spans = sink.spans()
    by_rank = {0: {}, 1: {}}
    for s in spans:
        if s["name"] == "rankwatch.step":
            by_rank[s["attrs"]["rankwatch.rank"]][s["attrs"]["rankwatch.step"]] = s
    measured = {r: json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)}
    job_id = by_rank[0][5]["attrs"]["rankwatch.job_id"]
    for rank, steps in by_rank.items():
        assert {5, 10, 12, 15, 20} <= steps.keys(), (rank, sorted(steps))
        for n, s in steps.items():
            a = s["attrs"]
            assert a["rankwatch.node"] == "n0" and a["rankwatch.mesh.dp"] == rank and a["rankwatch.mesh.tp"] == 0
            assert a["process.pid"] == measured[rank]["pid"] and a["rankwatch.job_id"] == job_id
            # The span is the rank's own measurement: inside the job's wall window, and as long
            # as the harness's step time for that step (which brackets the hook's, a little wider).
            assert t0 < s["start"] < s["end"] < t1
            harness = measured[rank]["step_times"][n - 1]
            assert harness - 0.05 <= s["end"] - s["start"] <= harness + 1e-3, (rank, n, s, harness)
            assert s["trace_id"] == otel.step_trace_id(job_id, n)
        # Step 12: rank 1 slept 5 s in forward, rank 0 waited for it in a collective.
        assert steps[12]["attrs"]["rankwatch.step.sampled"] == "slow" and steps[12]["end"] - steps[12]["start"] > 4.5
    assert by_rank[1][12]["attrs"]["rankwatch.step.forward_seconds"] > 4.5
    assert by_rank[0][12]["attrs"]["rankwatch.step.collective_wait_seconds"] > 3.0
    (hang,) = [s for s in spans if s["name"] == "rankwatch.hang"]
    a = hang["attrs"]
    assert a["rankwatch.rank"] == 1 and a["rankwatch.incident.id"] == hangs[0]["id"]
    assert a["rankwatch.incident.detail.alive"] is True and a["rankwatch.mesh.dp"] == 1
    assert "_injected_sleep_in_forward" in a.get("rankwatch.incident.detail.stacks", ""), a
    assert hang["status"] == 2  # STATUS_CODE_ERROR
    assert hang["start"] <= hang["end"] == pytest.approx(hangs[0]["detected_at"], abs=1e-6)
    assert hang["trace_id"] == otel.step_trace_id(job_id, hangs[0]["step"])
    assert hang["resource"]["service.name"] == "rankwatch-e2e" and hang["scope"] == "rankwatch.agent"
