"""Serving front ends: HTTP (FastAPI), and later gRPC."""
