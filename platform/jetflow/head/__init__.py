"""Causal / bidirectional parallel draft heads, their checkpoints, and head references."""

from jetflow.head.config import HeadArch, HeadConfig
from jetflow.head.io import check_fits, load_head, save_head
from jetflow.head.model import DraftHead
from jetflow.head.ref import HeadRef, LoadedHead, local_head_path

__all__ = ["DraftHead", "HeadArch", "HeadConfig", "HeadRef", "LoadedHead", "check_fits", "load_head",
           "local_head_path", "save_head"]
