"""Generated protobuf and gRPC code (do not edit; see scripts/gen_protos.py)."""
