"""The Python API: ``LLM`` and ``SamplingParams`` (re-exported by ``dist_inference_runner``).

A face of rank 0's engine, as the HTTP server is: the engine runs on a thread of the caller's process
(:mod:`pipeline.runtime.engine_thread`), fed by Python calls; :mod:`python_api.workers` starts the other
stages as processes of the runner; :mod:`python_api.params` and :mod:`python_api.outputs` turn Python values
into requests and answers into result objects. May import pipeline, tasks and comm; only the entry point
imports it.
"""

from python_api.llm import LLM, EngineDead
from python_api.params import SamplingParams
from python_api.outputs import Choice, RequestFailed, Result, Score

__all__ = ["LLM", "SamplingParams", "Result", "Choice", "Score", "EngineDead", "RequestFailed"]
