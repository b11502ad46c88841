"""An OpenAI-compatible HTTP front for the Triton server: /v1/completions, /v1/chat/completions, /v1/models,
adapter management for operators, and the metrics LLM routers read.

It is a process of its own beside tritonserver and talks to it over gRPC (the ``llm`` ensemble for
generations, the ``generator``'s control requests for everything else):

    python -m manylora.openai --triton-grpc 127.0.0.1:8001 --port 9000

``model`` names the base model or an adapter. The modules: config (settings), protocol (request
bodies), translate (request -> the ensemble's inputs), chat_template, models (what ``model`` names),
triton (the gRPC client), responses (bodies and server-sent events), errors, admin, metrics, app
(the routes), cli (the command line).
"""
