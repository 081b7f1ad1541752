"""``JobServicer``: JobService RPCs onto the ``JobController``. A SubmitJob spec is at most
``MAX_SPEC_BYTES`` (INVALID_ARGUMENT on ``spec``); its text fields may not hold NUL characters."""

from __future__ import annotations

import threading

from onpolicy.jobs.spec import SpecError
from onpolicy.jobs.spec_file import MAX_SPEC_BYTES
from onpolicy.rollout.engines import EngineUnavailable
from onpolicy.services import api

from ..common.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from ..common.server import GrpcServer, ServerConfig
from .controller import JobController, JobNotFound
from .convert import event_proto, job_proto, spec_from_proto
from .paths import PathRefused


def jobs_server(controller: JobController, config: ServerConfig,
                max_watch_streams: int | None = None) -> GrpcServer:
    """A started gRPC server answering the JobService for ``controller``."""
    server = GrpcServer(config)
    servicer = JobServicer(controller, max_watch_streams or DEFAULT_MAX_WATCH_STREAMS)
    server.add_service(api.SERVICE_NAMES["JobService"], servicer, api.jobs_pb2_grpc.add_JobServiceServicer_to_server)
    server.start()
    return server


#: Open WatchJob streams one controller serves at once (beyond: RESOURCE_EXHAUSTED).
DEFAULT_MAX_WATCH_STREAMS = 64


class JobServicer(api.jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, controller: JobController, max_watch_streams: int = DEFAULT_MAX_WATCH_STREAMS) -> None:
        self.controller = controller
        self.max_watch_streams = max_watch_streams
        self._watching = 0
        self._watch_lock = threading.Lock()

    def _record(self, job_id: str):
        if not job_id:
            raise InvalidArgument("job_id", "job_id is required")
        try:
            return self.controller.get(job_id)
        except JobNotFound:
            raise NotFound(f"no job {job_id!r}") from None

    def SubmitJob(self, request, context):
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "spec is required (the job to run)")
        if request.spec.ByteSize() > MAX_SPEC_BYTES:
            raise InvalidArgument("spec", f"{request.spec.ByteSize()} bytes; a job spec is at most "
                                          f"{MAX_SPEC_BYTES >> 20} MiB")
        try:
            rec = self.controller.submit(spec_from_proto(request.spec))
        except SpecError as e:
            (field, desc), *rest = [(f"spec.{f}", d) for f, d in e.violations]
            raise InvalidArgument(field, desc, *(FieldViolation(f, d) for f, d in rest)) from None
        except PathRefused as e:
            if e.denied:
                raise PermissionDenied(f"spec.{e.field}: {e}") from None
            raise InvalidArgument(f"spec.{e.field}", str(e)) from None
        except EngineUnavailable as e:  # e.g. engine: vllm-ascend on a machine without vllm-ascend
            raise FailedPrecondition(str(e)) from None
        return api.jobs_pb2.SubmitJobResponse(job=job_proto(rec))

    def GetJob(self, request, context):
        return api.jobs_pb2.GetJobResponse(job=job_proto(self._record(request.job_id)))

    def ListJobs(self, request, context):
        return api.jobs_pb2.ListJobsResponse(jobs=[job_proto(r) for r in self.controller.list()])

    def CancelJob(self, request, context):
        self._record(request.job_id)
        return api.jobs_pb2.CancelJobResponse(job=job_proto(self.controller.cancel(request.job_id)))

    def WatchJob(self, request, context):
        self._record(request.job_id)
        with self._watch_lock:
            if self._watching >= self.max_watch_streams:
                raise ResourceExhausted(f"{self._watching} WatchJob streams are open, the most this controller "
                                        "serves; close one or poll GetJob")
            self._watching += 1
        try:  # the stream lives as long as its client: watch() stops when the call is no longer active
            for ev in self.controller.watch(request.job_id, alive=context.is_active):
                yield api.jobs_pb2.WatchJobResponse(event=event_proto(ev))
        finally:
            with self._watch_lock:
                self._watching -= 1
