"""``python -m runtime.serve``: the OpenAI-compatible server (``runtime/serving/uvicorn_server.py``)."""
from runtime.serving.uvicorn_server import main

if __name__ == "__main__":
    main()
