"""Deploying into a Triton fleet: a plain model repository and the Python environment its models run in.

    manylora.deploy.repository     render the model repository (placeholders filled, paths, the environment named)
    manylora.deploy.packed_env     pack the Python environment the models need, for EXECUTION_ENV_PATH
    manylora.deploy.server_flags   the tritonserver flags the models need; the administrative APIs to restrict
    manylora.deploy.stub           which Python a Python-backend stub embeds

``python -m manylora.deploy render|pack-env`` (console script ``manylora-deploy``); docs/deployment.md.
Nothing here is imported by the engine, the kernels or the models.
"""
