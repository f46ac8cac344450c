"""The networked cache service: a `Store` behind HTTP, with auth, tenancy, limits and metrics.

`create_app(ServerConfig(...))` builds the FastAPI app; `kvstash serve` runs it under uvicorn.
"""

from kvserver.app import create_app
from kvserver.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
