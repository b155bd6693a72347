"""`speculative serve`: an OpenAI-compatible HTTP server over the batched engine.

``create_app(state)`` builds the FastAPI app around an already loaded
:class:`~speculative.server.state.ServerState` (target, drafters, batched engine), so a
wrapper (e.g. a Ray Serve deployment) can build the state itself and reuse the app.
"""

from speculative.server.app import create_app
from speculative.server.state import ServerConfig, ServerState, load_state

__all__ = ["ServerConfig", "ServerState", "create_app", "load_state"]
