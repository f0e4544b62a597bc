"""Federated checkpoints: each group's files, the manifest that verifies them, and the resume that picks one."""
