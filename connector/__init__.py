"""The engine side of the cache: lookup -> prefetch -> load, and write-behind save.

`KVConnector` is engine-agnostic and imports no torch; `connector.hf` adapts it to
transformers models. Engine adapters for vLLM and SGLang live beside it.
"""

from connector.core import KVConnector, LoadTarget
from connector.layout import ChunkLayout
from connector.policy import LoadPlan, LoadPolicy

__all__ = ["ChunkLayout", "KVConnector", "LoadPlan", "LoadPolicy", "LoadTarget"]
