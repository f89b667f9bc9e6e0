"""The detectors: pure functions of (now, ranks' progress and work, config) that name hangs and stragglers."""
