"""The endpoints, one module per kind; each module's `router` holds its handlers, which read the
server's `state.ServingState` from `request.app.state.serving`."""
