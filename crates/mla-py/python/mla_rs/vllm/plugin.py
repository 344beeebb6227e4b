"""The ``vllm.general_plugins`` entry point: vLLM runs ``register()`` in each of its processes,
which puts ``MlaRsBackend`` in vLLM's ``CUSTOM`` attention-backend slot. Importing this module
imports nothing of vLLM; ``register`` imports only vLLM's registry (the backend class itself is
loaded by vLLM when it is selected)."""

BACKEND_CLASS = "mla_rs.vllm.backend.MlaRsBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
