"""Start-up configuration: the options dataclass (argparse and YAML come from it), the plan, the
partition of layers into stages, stage memory (--stage-memory), the KV budget (--budget auto),
--dry-run's plan and time estimate (estimate) and the scheduler's sizes and mode (pass_sizes). The plan
resolves options once into small typed configs per component (components); components below it get
what they need, not RunOptions.

May import: pipeline.models (specs, sizes), pipeline.loading (config/tokenizer reads), tasks (request
files), comm (addresses). Never pipeline.runtime, pipeline.scheduling
or serve.
"""
