"""The speculative decoder, the AR baseline on the same machinery, sampling and per-call stats."""

from jetflow.exports import lazy_exports

# Imported on first use: `jetflow.decode.config` alone (the options of every entry point) stays torch-free.
__getattr__, __dir__ = lazy_exports(__name__, {
    ".config": ("DecodeConfig",),
    ".decoder": ("Decoder", "Generation"),
    ".prompt": ("encode_prompt", "stop_token_ids"),
    ".sampling": ("target_probs",),
    ".stats": ("DecodeStats",),
})

__all__ = ["DecodeConfig", "DecodeStats", "Decoder", "Generation", "encode_prompt", "stop_token_ids", "target_probs"]
