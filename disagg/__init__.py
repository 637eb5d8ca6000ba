"""disagg: disaggregated prefill/decode LLM serving."""

from disagg.config import EngineConfig, Role
from disagg.request import FinishReason, SamplingParams

__all__ = ["LLM", "EngineConfig", "FinishReason", "Role", "SamplingParams"]


def __getattr__(name: str):
    # The engine pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from disagg.engine.llm import LLM

        return LLM
    raise AttributeError(name)
