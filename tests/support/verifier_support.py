"""Helpers of the verifier tests: sample messages, submitting, reading a metrics registry."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from onpolicy.services import api
from onpolicy.services.common.convert import completion_to_proto

MODEL = "tiny-qwen3"
KV_TILE = 16


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a text exposition as ``{(sample name, frozenset(labels.items())): value}``."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample_msg(c, *, job: str = "job-a", step: int = 1, source: str = "onpolicy", logprobs=None,
               weight_version: int | None = None, fingerprint: str = "") -> object:
    comp = completion_to_proto(c, "")
    if logprobs is not None:
        del comp.logprobs[:]
        comp.logprobs.extend(logprobs)
    if weight_version is not None:
        comp.weight_version = weight_version
    return api.verifier_pb2.Sample(job_id=job, step=step, completion=comp, source=source,
                                   kernel_fingerprint=fingerprint)


def submit(sv, samples, wait: bool = True):
    return sv.SubmitSamples(api.verifier_pb2.SubmitSamplesRequest(samples=list(samples), wait=wait), None)


def scrape(registry) -> dict[tuple[str, frozenset], float]:
    """``parse`` of what ``registry`` exports."""
    return parse(generate_latest(registry).decode())


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels`` (KeyError if none, ValueError if several)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    if not hits:
        raise KeyError(f"{name}{labels} not exported")
    if len(hits) > 1:
        raise ValueError(f"{name}{labels} matches {len(hits)} series")
    return hits[0]
