"""warmgate engine workers: the worker entry and its internal HTTP API (server.py), the fork server, and one
folder per backend (native/, vllm/)."""
