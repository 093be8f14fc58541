"""Front ends over the loop: the transport-neutral scheduler thread (``request_loop``) and its
refusals (``request_error``), OpenAI requests, replies and the HTTP server, the Triton Inference
Server's tensors and model repository, metrics."""
