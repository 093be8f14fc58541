"""Front ends over the loop: the transport-neutral scheduler thread (``request_loop``), OpenAI
requests and replies, the Triton Inference Server's tensors and model repository, metrics."""
