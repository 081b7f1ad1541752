"""VerifierService: recomputes finished rollouts on the training path and reports logdiff.

``servicer`` (the RPCs: rate cap, bounded queue, wait/async), ``worker`` (drains the queue into
batched recomputes), ``service`` (builds it on a certified operator set), ``metrics`` (the
verifier's Prometheus collector, ``VerifierMetrics``), ``exporter`` (HTTP ``/metrics`` and the
controller's merging ``MetricsHub``); rollout and trainer collectors are in
``onpolicy.services.common.role_metrics``. The domain side lives in ``onpolicy.verification``
(``verifier``, ``sink``, ``sampling``, ``mismatch_store``, ``config``).
"""
