"""``python -m runtime.ray_serve``: the server's routes on Ray Serve replicas
(``runtime/serving/ray_serve.py``)."""
from runtime.serving.ray_serve import main

if __name__ == "__main__":
    main()
