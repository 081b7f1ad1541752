"""gRPC services (rollout, trainer, verifier, jobs) and their shared plumbing."""
