"""VerifierService: recomputes finished rollouts on the training path and reports logdiff."""
