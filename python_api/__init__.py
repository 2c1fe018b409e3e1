"""The Python API: ``LLM`` and ``SamplingParams`` (re-exported by ``dist_inference_runner``; README.md lists
the modules). A face of the engine: may import pipeline, tasks and comm; only the entry point imports it.
"""

from python_api.llm import LLM, EngineDead
from python_api.params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from python_api.outputs import Choice, Logprob, RequestFailed, Result, Score

RequestOutput, CompletionOutput = Result, Choice  # vLLM's names for them

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "Result", "Choice", "Score",
           "Logprob", "RequestOutput", "CompletionOutput", "EngineDead", "RequestFailed"]
