"""The agent's front door: the gRPC service, who may call, stream admission, credentials, listeners."""
