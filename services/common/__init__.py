"""Shared gRPC plumbing of every onpolicy service.

``server`` (``ServerConfig``, ``GrpcServer``: lifecycle, health, reflection, TLS), ``auth`` (bearer
token interceptor), ``errors`` (the one interceptor mapping domain errors to status codes),
``client`` (``connect`` and error helpers) and ``protogen`` (code generation from ``protos/``).
This package imports nothing itself, so ``protogen`` stays loadable during the build.
"""
