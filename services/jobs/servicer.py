"""``JobServicer``: JobService RPCs onto the ``JobController``."""

from __future__ import annotations

from onpolicy.jobs.spec import SpecError
from onpolicy.rollout.engines import EngineUnavailable
from onpolicy.services import api

from ..common.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from .controller import JobController, JobNotFound, check_supported
from .convert import event_proto, job_proto, spec_from_proto


class JobServicer(api.jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, controller: JobController) -> None:
        self.controller = controller

    def _record(self, job_id: str):
        if not job_id:
            raise InvalidArgument("job_id", "job_id is required")
        try:
            return self.controller.get(job_id)
        except JobNotFound:
            raise NotFound(f"no job {job_id!r}") from None

    def SubmitJob(self, request, context):
        try:
            spec = spec_from_proto(request.spec)
            check_supported(spec)
        except SpecError as e:
            (field, desc), *rest = [(f"spec.{f}", d) for f, d in e.violations]
            raise InvalidArgument(field, desc, *(FieldViolation(f, d) for f, d in rest)) from None
        try:
            self.controller.preflight(spec)
        except EngineUnavailable as e:  # e.g. engine: vllm-ascend on a machine without vllm-ascend
            raise FailedPrecondition(str(e)) from None
        return api.jobs_pb2.SubmitJobResponse(job=job_proto(self.controller.submit(spec)))

    def GetJob(self, request, context):
        return api.jobs_pb2.GetJobResponse(job=job_proto(self._record(request.job_id)))

    def ListJobs(self, request, context):
        return api.jobs_pb2.ListJobsResponse(jobs=[job_proto(r) for r in self.controller.list()])

    def CancelJob(self, request, context):
        self._record(request.job_id)
        return api.jobs_pb2.CancelJobResponse(job=job_proto(self.controller.cancel(request.job_id)))

    def WatchJob(self, request, context):
        self._record(request.job_id)
        for ev in self.controller.watch(request.job_id, alive=context.is_active):
            yield api.jobs_pb2.WatchJobResponse(event=event_proto(ev))
