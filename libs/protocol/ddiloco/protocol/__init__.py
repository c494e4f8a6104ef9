"""ddiloco.protocol: the synchronizer's gRPC contract as Python.

``wire`` converts between dataclasses and the generated protobuf code in ``ddiloco.v1`` (the only
module that imports it), ``client`` is the one client of the service (channels with TLS and
bearer tokens, the Sync stream, FetchState, GetStatus), and ``status`` is ``ddiloco status``.
"""
