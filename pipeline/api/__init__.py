"""The Python API: ``LLM`` and ``SamplingParams`` (re-exported by ``dist_inference_runner``).

One more source feeding rank 0's pipeline, as the HTTP server is: :mod:`pipeline.api.engine` runs
serve mode's rank-0 loop (:class:`serve.engine.ServeRank`) in a thread of the caller's process, fed
from Python calls instead of HTTP; :mod:`pipeline.api.workers` starts the other stages as processes
of the runner; :mod:`pipeline.api.params` and :mod:`pipeline.api.results` turn Python values into
request lines and output lines into result objects. May import every package of the project.
"""

from pipeline.api.llm import LLM, EngineDead
from pipeline.api.params import SamplingParams
from pipeline.api.results import Choice, RequestFailed, Result, Score

__all__ = ["LLM", "SamplingParams", "Result", "Choice", "Score", "EngineDead", "RequestFailed"]
