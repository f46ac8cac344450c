"""vLLM plugin (entry point group `vllm.general_plugins`, which vLLM loads in each of its
processes: front end, engine core, workers): registers `KvstashConnector` with vLLM's KV
connector factory by name, lazily (nothing is imported until vLLM asks for the class).

With it, `"kv_connector": "KvstashConnector"` needs no `kv_connector_module_path`, and
vLLM's `MultiConnector` can rebuild kvstash's stats in its front end, which looks
connectors up by name only (without the name registered, its stats logger raised
"Connector 'KvstashConnector' is not registered" and stopped the engine).
"""

from __future__ import annotations

import logging

CONNECTOR = "KvstashConnector"
MODULE = "connector.vllm_v1"


def register() -> None:
    """Runs in every vLLM process where kvstash is installed, used or not: it never raises."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError:  # registered already (the plugin, or connector.vllm_v1 on import)
        pass
    except (ImportError, AttributeError) as exc:  # a vLLM without this factory
        logging.getLogger("vllm.kvstash").debug("KvstashConnector not registered: %s", exc)
