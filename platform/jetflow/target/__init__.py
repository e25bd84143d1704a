"""The frozen target LLM."""

from jetflow.target.bundled import BUNDLED, prepare_bundled
from jetflow.target.model import TargetModel, TargetOutput, default_layer_ids

__all__ = ["BUNDLED", "TargetModel", "TargetOutput", "default_layer_ids", "prepare_bundled"]
