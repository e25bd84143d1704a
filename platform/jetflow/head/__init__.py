"""Causal / bidirectional parallel draft heads, their checkpoints, and head references."""

from jetflow.exports import lazy_exports

# Imported on first use: `jetflow.head.config` alone (what `TrainConfig` builds on) stays torch-free.
__getattr__, __dir__ = lazy_exports(__name__, {
    ".config": ("HeadArch", "HeadConfig"),
    ".io": ("check_fits", "load_head", "save_head"),
    ".model": ("DraftHead",),
    ".ref": ("HeadRef", "LoadedHead", "local_head_path"),
})

__all__ = ["DraftHead", "HeadArch", "HeadConfig", "HeadRef", "LoadedHead", "check_fits", "load_head",
           "local_head_path", "save_head"]
