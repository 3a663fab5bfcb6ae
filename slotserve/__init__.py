"""slotserve: LLM serving on Kubernetes with continuous batching and shared admission."""

from pathlib import Path

__version__ = "0.1.0"

# In a wheel the parts are real subpackages (slotserve/engine, ...). In a source checkout they
# are the top-level folders engine/, gateway/, operator/; adding the checkout root to this
# package's search path gives them the same import names without putting the root on sys.path,
# where operator/ would shadow the standard library's `operator` module.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "engine" / "__init__.py").is_file() and not (
    Path(__file__).parent / "engine"
).exists():
    __path__.append(str(_checkout))
