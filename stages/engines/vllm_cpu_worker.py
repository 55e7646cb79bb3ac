"""vLLM's worker extension for CPU replicas of several tensor-parallel workers (their own spawned
processes: vLLM's CPU platform always spawns them). Importing this module in a worker applies
vllm_engine.keep_cpu_linear_weights there, as VLLMEngine.start does in the engine's own process,
so the workers' linear layers keep their weights and a new version can be loaded in place."""
from stages.engines.vllm_engine import keep_cpu_linear_weights

keep_cpu_linear_weights()


class KeepCpuLinearWeights:
    """Named by LLM(worker_extension_cls=...): vLLM imports it in every worker before the model loads."""
