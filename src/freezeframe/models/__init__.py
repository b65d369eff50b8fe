"""Reference models used by examples, tests and benchmarks.

Importing this package registers the ``freezeframe::attention`` custom op (``ATTENTION_OP``),
the splitting op of the reference Llama.
"""

from freezeframe.models.attention import (
    ATTENTION_OP,
    ATTN_METADATA_KEY,
    AttentionHostMetadata,
)
from freezeframe.models.kv_cache import BlockAllocator, KVCacheConfig
from freezeframe.models.llama import LlamaConfig, LlamaModel, build_llama

__all__ = [
    "ATTENTION_OP",
    "ATTN_METADATA_KEY",
    "AttentionHostMetadata",
    "BlockAllocator",
    "KVCacheConfig",
    "LlamaConfig",
    "LlamaModel",
    "build_llama",
]
