"""End to end: the HTTP/websocket API, conformance against the real client, load, capacity, metrics, the ledger."""
