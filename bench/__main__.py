"""``python -m bench``: ``decoding.py``."""
from bench.decoding import main

if __name__ == "__main__":
    main()
