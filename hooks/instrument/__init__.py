"""The rank's instrumentation: the hot-path recorder, collective timers, the client stream to the agent."""
