"""Test-support backends: fast deterministic fakes of llama-server and Ollama, an Ollama simulator
on top of a real llama-server, and helpers that start them (and mitmdump) for tests and scripts.

Nothing here is imported by the addon itself.
"""
