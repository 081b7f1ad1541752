"""Build the verifier service: load the model on a certified operator set, wrap it."""

from __future__ import annotations

from onpolicy.kernels import KernelConfig
from onpolicy.verification.config import VerifierConfig

from ..common.model import load_certified
from .servicer import VerifierServicer


def build_verifier_service(model_ref: str, kernel_config: KernelConfig,
                           config: VerifierConfig | None = None) -> VerifierServicer:
    if not kernel_config.consistent:
        raise ValueError("the verifier recomputes on the training path: it needs consistent kernels")
    return VerifierServicer(load_certified(model_ref, kernel_config), config)
