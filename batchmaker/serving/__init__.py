"""Serving over ZeroMQ: the wire protocol, the server in front of an Engine, the client library,
the command line and the demo. Nothing is imported here, so `batchmaker --help` and the client
stay free of torch (docs/protocol.md is the protocol reference)."""
