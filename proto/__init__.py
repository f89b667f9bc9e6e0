"""Wire messages of rankwatch, generated from ``rankwatch/v1/agent.proto``.

Regenerate with ``python -m rankwatch.proto.generate``; a test fails when the
checked-in modules are stale.
"""

from rankwatch.proto.rankwatch.v1 import agent_pb2 as pb
from rankwatch.proto.rankwatch.v1 import agent_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
