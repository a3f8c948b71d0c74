"""The link between the HTTP workers and the engine process: the wire, the client the workers use, the engine's
server and the master's supervisor of engine processes."""
