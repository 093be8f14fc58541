"""The Triton Python-backend model under the name that model repositories written before it moved
import (``runtime/serving/tritonserver_model.py``)."""
from runtime.serving.tritonserver_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
