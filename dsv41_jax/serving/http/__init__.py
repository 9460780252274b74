"""The OpenAI-compatible HTTP server (`dsv41 serve`): protocol, engine thread, app, metrics."""
