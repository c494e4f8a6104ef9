"""ddiloco.protocol: the synchronizer's gRPC contract as Python.

``wire`` holds the service's messages as dataclasses and converts them to and from the generated
protobuf code in ``ddiloco.v1`` (its ``convert`` and ``stubs`` are the only modules that import
it), ``client`` is the one client of the service (channels with TLS and bearer tokens, the Sync
stream, FetchState, GetStatus), and ``status`` is ``ddiloco status``.
"""
