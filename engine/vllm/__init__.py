"""The vLLM backend: vLLM's engine behind warmgate's engine API, its weights bound from warmgate's cache.

``loader.py`` is the ``warmgate`` load format (a vLLM general plugin, ``plugin.py``); ``engine.py`` runs
vLLM's engine on a thread and serves it through engine/server.py, like the native engine.
"""
