"""The job across nodes: the coordinator, relays, the decision log, election, goodput."""
