"""Every server over the loop: the OpenAI-compatible one on uvicorn (``uvicorn_server``) and on Ray
Serve (``ray_serve``), Triton Inference Server's Python-backend model (``tritonserver_model``) and
the PyTriton binding, the flags the server commands share; and what they are built from: the
transport-neutral scheduler thread (``request_loop``) and its refusals (``request_error``), OpenAI
requests and replies, the Triton Inference Server's tensors and model repository, metrics."""
