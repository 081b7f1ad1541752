"""Domain errors and the ONE server interceptor that turns them into gRPC status codes.

Servicers never call ``context.abort``: they raise one of the exceptions below (or let a
``ValueError`` from domain validation escape) and ``ErrorInterceptor`` maps it —

===============================  =====================  ===========================================
exception                        status code            details
===============================  =====================  ===========================================
``InvalidArgument``              INVALID_ARGUMENT       ``google.rpc.BadRequest`` field violations
``ValueError`` (any other)       INVALID_ARGUMENT       the message
``NotFound``                     NOT_FOUND              the message
``FailedPrecondition``           FAILED_PRECONDITION    the message
``ResourceExhausted``            RESOURCE_EXHAUSTED     the message
``Unavailable``                  UNAVAILABLE            the message (the client may retry)
anything else                    INTERNAL               ``internal error <id>``; traceback logged
===============================  =====================  ===========================================

It wraps unary and streaming handlers alike (a streaming handler's errors surface while the
response iterator is consumed). Unexpected exceptions never reach the client: only an opaque error
id does, which also appears in the server log next to the traceback.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldViolation:
    field: str
    """Path of the offending request field, e.g. ``params.temperature`` or ``prompts[3].prompt_ids``."""
    description: str


class ServiceError(Exception):
    """Base of the domain errors a servicer raises; ``code`` is the status they map to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError, ValueError):
    """A request field is invalid, whatever the server's state."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str, *more: FieldViolation) -> None:
        self.violations = (FieldViolation(field, description), *more)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    """The request is well formed but the server is not in a state to carry it out."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(ServiceError):
    """The caller may not use what it named (a path outside the server's roots); the message names
    the field."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(ServiceError):
    """The service cannot answer now (shutting down, engine stopped); retrying may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


def to_status(exc: BaseException) -> tuple[grpc.Status | None, str | None]:
    """The status an exception maps to, or ``(None, error_id)`` for an unexpected one."""
    if isinstance(exc, InvalidArgument):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in exc.violations]))
        return rpc_status.to_status(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc),
                                                      details=[detail])), None
    if isinstance(exc, ServiceError | ValueError):
        code = exc.code if isinstance(exc, ServiceError) else grpc.StatusCode.INVALID_ARGUMENT
        return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=str(exc))), None
    return None, uuid.uuid4().hex[:12]


def _abort(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    if context.code() not in (None, grpc.StatusCode.OK):
        raise exc  # the handler already aborted; the exception is grpc's own signal
    status, error_id = to_status(exc)
    if status is None:
        log.error("%s failed (error %s)", method, error_id, exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error {error_id}")
    context.abort_with_status(status)


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(behavior)
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request_or_iterator, context)
        except Exception as e:
            _abort(context, e, method)

    return call


def _wrap_stream(behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Iterator[Any]]:
    @functools.wraps(behavior)
    def call(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request_or_iterator, context)
        except Exception as e:
            _abort(context, e, method)

    return call


_FACTORIES = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler, _wrap_unary),
    "stream_unary": (grpc.stream_unary_rpc_method_handler, _wrap_unary),
    "unary_stream": (grpc.unary_stream_rpc_method_handler, _wrap_stream),
    "stream_stream": (grpc.stream_stream_rpc_method_handler, _wrap_stream),
}


def rewrap(handler: grpc.RpcMethodHandler, kind_behavior: Callable[[str, Callable[..., Any]], Callable[..., Any]],
           ) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers whose behaviour is ``kind_behavior(kind, old)``."""
    for kind, (factory, _) in _FACTORIES.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return factory(kind_behavior(kind, behavior), request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    raise TypeError("RPC method handler has no behaviour")


def wrap_handler(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """``handler`` with its behaviour wrapped by the error mapping."""
    if handler is None:
        return None
    return rewrap(handler, lambda kind, behavior: _FACTORIES[kind][1](behavior, method))


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps the domain errors raised by any handler of the server to status codes (see module doc)."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return wrap_handler(continuation(handler_call_details), handler_call_details.method)
