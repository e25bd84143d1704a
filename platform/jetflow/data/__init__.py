"""Prompt sets: named sets read from installed packages, and JSONL files of prompts."""

from jetflow.data.prompts import (
    PROMPT_SETS,
    SPLITS,
    PromptItem,
    PromptSetUnavailableError,
    load_prompts,
    prompt_set_names,
    register_prompt_set,
    spread_prompts,
)

__all__ = [
    "PROMPT_SETS",
    "SPLITS",
    "PromptItem",
    "PromptSetUnavailableError",
    "load_prompts",
    "prompt_set_names",
    "register_prompt_set",
    "spread_prompts",
]
