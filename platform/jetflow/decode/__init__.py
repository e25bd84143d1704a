"""The speculative decoder, the AR baseline on the same machinery, sampling and per-call stats."""

from jetflow.decode.decoder import Decoder, Generation
from jetflow.decode.prompt import encode_prompt, stop_token_ids
from jetflow.decode.sampling import DecodeConfig, target_probs
from jetflow.decode.stats import DecodeStats

__all__ = ["DecodeConfig", "DecodeStats", "Decoder", "Generation", "encode_prompt", "stop_token_ids", "target_probs"]
