"""The HTTP routes of `tangram serve`, one APIRouter per area; each handler is a
thin call into :class:`executor.server.service.Service`."""
