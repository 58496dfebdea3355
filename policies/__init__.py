"""Expert policies: plain functions ``PAS(graph, resource) -> graph``."""

# shipped policy name -> the module in this package that defines it
SHIPPED = {"PASSingle": "single", "PASData": "data", "PASMegatronTP": "megatron", "PASHybrid": "hybrid",
           "PASCol": "gallery", "PASRow": "gallery", "PAS1F1B": "pipeline", "PASGPipe": "pipeline",
           "PAS1F1BInterleaved": "pipeline", "PASMegatron": "megatron3d", "PASPipeDream": "pipedream"}


def resolve(name: str) -> str:
    """``"PASData"`` -> ``"policies.data:PASData"``; ``file.py:Name`` / ``module:Name`` pass through.

    Raises:
        ValueError: a bare name that is not a shipped policy.
    """
    if ":" in name:
        return name
    if name not in SHIPPED:
        raise ValueError(f"unknown policy {name!r}: use one of {sorted(SHIPPED)}, or 'file.py:Name' / 'module:Name'")
    return f"policies.{SHIPPED[name]}:{name}"
