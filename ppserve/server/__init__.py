"""The gRPC edge of ppserve: servicer, asyncio engine wrapper, client and CLI.

The only package that imports the generated protobuf modules (ppserve.server.gen). Importing it is
light: torch, ray and the engine load only when a server is actually built.
"""
