"""The HTTP routes, one APIRouter per area: chunks, lookups, admin (keys, stats), events
and health (liveness, readiness, metrics). Each route validates, calls one service and
maps its typed result to a status code; kvserver.app includes the routers."""
