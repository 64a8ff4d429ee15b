"""The router's client side: request validation, the field allowlist, the OpenAPI document, request
ids, the connection protocol and the ASGI middleware.
"""
