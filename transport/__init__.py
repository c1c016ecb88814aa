"""The framed tensor transport: sans-IO wire format, tensor codecs, and the asyncio RPC on top.

Standalone: nothing here imports `swarmd`. Limits live in `transport.limits`, frames in
`transport.wire`, tensor payloads in `transport.codecs`; the byte layout is docs/protocol.md.
"""
