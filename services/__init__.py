"""The services layer (docs/architecture.md): gRPC servicers and servers of the roles — ``rollout/``,
``trainer/``, ``verifier/`` — and of the job ``controller/`` (JobService, the GRPO loop over the role
services, persisted job state), their shared plumbing (``common/``: server, auth, errors, client,
metrics), the role registry (``roles.py``) and the Ray runtime they run on (``cluster/``)."""
