"""VerifierService: recomputes finished rollouts on the training path and reports logdiff.

``servicer`` (the RPCs: rate cap, bounded queue, wait/async), ``worker`` (drains the queue into
batched recomputes), ``service`` (builds it on a certified operator set), ``metrics`` (the
verifier's Prometheus collector, ``VerifierMetrics``); the HTTP ``/metrics`` endpoint and the
controller's merging ``MetricsHub`` serve every role (``onpolicy.services.common.metrics_endpoint``),
as the rollout and trainer collectors do (``onpolicy.services.common.role_metrics``). The domain
side lives in ``onpolicy.verification`` (``verifier``, ``sink``, ``queue``, ``mismatch_store``,
``config``).
"""
