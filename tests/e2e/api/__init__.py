"""End to end: the HTTP/websocket API and the real client: conformance on every transport, hostile clients, bounds, uploads."""
