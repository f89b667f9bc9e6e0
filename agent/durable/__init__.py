"""What outlives the agent: incidents and decisions in JSON Lines under a private state directory."""
