"""Where the InferencePool lives in the Kubernetes API, and the label that ties a pool's objects.

The operator serves and generates the CRD with these; the gateway lists and watches pools with
them and finds a pool's engines through the EndpointSlices that carry ``POOL_LABEL``.
"""

from __future__ import annotations

GROUP = "slotserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("ipool",)
# On the pool's pods and Service (so also its EndpointSlices): the pool's name.
POOL_LABEL = f"{GROUP}/pool"
# The engine port's name on the pool's Service; its EndpointSlices carry the port number under it.
ENGINE_PORT_NAME = "http"
