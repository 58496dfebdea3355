"""Side-by-side measurements of cube against torch-native equivalents (``python -m benchmarks``)."""
