"""`kvtier plan`: exact KV-cache sizing for real models on real accelerators."""

from kvtier.plan.catalog import GPUS, MODELS, gpu_spec, model_spec
from kvtier.plan.sizing import PlanResult, plan
from kvtier.plan.specs import GPUSpec, ModelSpec

__all__ = ["GPUS", "MODELS", "GPUSpec", "ModelSpec", "PlanResult", "gpu_spec", "model_spec", "plan"]
