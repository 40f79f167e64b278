"""Generated protobuf and gRPC modules for ppserve.v1 (by ppserve.server.codegen; do not edit)."""
