"""What the agent exports, apart from what it detects: Prometheus collectors for the node's
ranks (:mod:`.metrics`), the job (:mod:`.jobmetrics`) and the host (:mod:`.host`), and
OpenTelemetry spans and metrics over OTLP (:mod:`.otel`, documented in OTEL.md).
GPU metrics stay with the GPU monitor (``rankwatch.agent.gpu.gauges``)."""
