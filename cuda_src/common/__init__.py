"""Pieces the kernel families share: DSL helpers and the export loop."""
