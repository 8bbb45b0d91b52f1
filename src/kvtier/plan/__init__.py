"""`kvtier plan`: exact KV-cache sizing for real models on real accelerators.

Public API (other modules and the simulator use it): `model_spec`, `gpu_spec`, `plan`.
No torch here: plan starts in well under a second.
"""

from kvtier.plan.catalog_gpus import GPUS, gpu_spec
from kvtier.plan.catalog_models import MODELS, model_spec
from kvtier.plan.sizing import PlanResult, plan
from kvtier.plan.specs import GPUSpec, ModelSpec

__all__ = ["GPUS", "MODELS", "GPUSpec", "ModelSpec", "PlanResult", "gpu_spec", "model_spec", "plan"]
