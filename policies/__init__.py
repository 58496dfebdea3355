"""Expert policies: plain functions ``PAS(graph, resource) -> graph``."""
