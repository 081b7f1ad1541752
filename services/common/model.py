"""Load a service's model on an operator set certified on this machine.

Services refuse to start on an uncertified backend: if no certificate exists for this machine and
kernel config, the selftest runs once for the model's shapes and its report is saved.
"""

from __future__ import annotations

import logging

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.selftest import is_certified, run_selftest, save_certificate
from onpolicy.models.loading import LoadedModel
from onpolicy.models.registry import load_model

log = logging.getLogger(__name__)


class UncertifiedBackend(RuntimeError):
    """The operator set failed its invariance probes on this machine."""


def ensure_certified(config: KernelConfig, lm: LoadedModel) -> None:
    if not config.consistent or is_certified(config):
        return  # the fast backend makes no invariance promise, so there is nothing to certify
    report = run_selftest(config, lm.config.probe_shapes())
    save_certificate(report, config)
    if not report.certified:
        failed = ", ".join(p.name for p in report.probes if not p.passed)
        raise UncertifiedBackend(f"backend {config.fingerprint} failed its selftest on this machine ({failed}); "
                                 "refusing to serve")
    log.info("certified %s on this machine (%d probes)", config.fingerprint, len(report.probes))


def load_certified(model_ref: str, config: KernelConfig) -> LoadedModel:
    lm = load_model(model_ref, get_backend(config))
    ensure_certified(config, lm)
    return lm
