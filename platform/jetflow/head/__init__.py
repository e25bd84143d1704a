"""Causal / bidirectional parallel draft heads and their checkpoints."""

from jetflow.head.config import HeadConfig
from jetflow.head.io import check_fits, load_head, resolve_head_path, save_head
from jetflow.head.model import DraftHead

__all__ = ["DraftHead", "HeadConfig", "check_fits", "load_head", "resolve_head_path", "save_head"]
