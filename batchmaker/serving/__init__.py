"""Serving over ZeroMQ: the wire protocol, the server in front of an Engine, the client library,
the command line and the demo; and the OpenAI-compatible HTTP front (http.py and the modules it
imports), loaded only by `batchmaker serve --http`. Nothing is imported here, so `batchmaker
--help` and the client stay free of torch (docs/protocol.md is the protocol reference)."""
