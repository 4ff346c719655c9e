"""Generation: JetStream's engine interface (`Engine`, `JaxEngine`), sampling, and continuous batching."""

from hfjax.rollout.engine import JaxEngine
from hfjax.rollout.generator import OfflineGenerator, SampleOutput
from hfjax.rollout.interface import (
    DecodeState,
    Engine,
    PrefillResult,
    ResultTokens,
    power_of_two_at_least,
    prefill_buckets,
)
from hfjax.rollout.sampling import SamplingError, SamplingParams

__all__ = [
    "DecodeState",
    "Engine",
    "JaxEngine",
    "OfflineGenerator",
    "PrefillResult",
    "ResultTokens",
    "SampleOutput",
    "SamplingError",
    "SamplingParams",
    "power_of_two_at_least",
    "prefill_buckets",
]
