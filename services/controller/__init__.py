"""The job controller: JobService, the GRPO loop over the role services, and persisted job state."""
