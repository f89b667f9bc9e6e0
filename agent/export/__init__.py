"""What the agent exports, apart from what it detects: Prometheus collectors for the node's
ranks (:mod:`.prom_node`), the job (:mod:`.prom_job`), the host (:mod:`.prom_host`), the
durable files (:mod:`.prom_store`) and the front door (:mod:`.prom_refusals`), and
OpenTelemetry spans and metrics over OTLP (:mod:`.otel`, :mod:`.spans`; documented in docs/opentelemetry.md).
GPU metrics stay with the GPU monitor (``rankwatch.agent.gpu.gauges``)."""
