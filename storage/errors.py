"""The few typed errors that cross the storage boundary; backends map their own to these."""


class StoreError(Exception):
    """Base of every error a store raises."""


class ConfigError(StoreError, ValueError):
    """A bad store URL or option, or an unusable root, found at open time."""


class InvalidKey(StoreError, ValueError):
    """A key that does not match the key format (`<16 hex>/<32 hex>`)."""


class InvalidChunk(StoreError, ValueError):
    """A blob that is not a valid chunk for the key it is stored under."""


class StoreUnavailable(StoreError):
    """The backend could not be reached or failed (network, I/O, timeout, open breaker)."""


class StoreFull(StoreError):
    """The backend has no room (ENOSPC, quota) even after eviction."""
