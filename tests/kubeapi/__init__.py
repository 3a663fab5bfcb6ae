"""An emulated Kubernetes API server for tests, built on kmock's public API.

Real clients (the ``kubernetes`` package, kopf, kubectl-style HTTP) talk to it over HTTP. It
stores objects with resourceVersions, streams and resumes watches, validates writes (CRD
schemas, built-in kinds, test admission policies) and collects garbage by ownerReferences.
What it emulates and what it does not: docs/testing.md.

    async with ApiServer() as server, kmock.Server(server) as http:  # in the test's loop
        server.resources.load_bundled()
        server.add_crd(crd)

    apiserver = ApiServerThread([crd]).start()  # on its own thread, for blocking clients
"""

from .admission import Admission, Policy
from .meta import label_matches, merge_patch, selector_matches
from .server import ApiServer, Call, Write
from .store import Event, Store
from .thread import ApiServerThread

__all__ = [
    "Admission",
    "ApiServer",
    "ApiServerThread",
    "Call",
    "Event",
    "Policy",
    "Store",
    "Write",
    "label_matches",
    "merge_patch",
    "selector_matches",
]
