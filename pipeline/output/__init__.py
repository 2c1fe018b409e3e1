"""What the last rank makes of sampled tokens: per-row state, stop strings, streaming deltas, best_of
selection (head) and the OpenAI objects (results).

May import pipeline.sampling and tasks. Never the runtime loops or serve.
"""
