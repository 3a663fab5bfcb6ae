"""slotserve's benchmarks: scripts run as ``python bench/NAME.py`` or ``slotserve bench NAME``.

Each script imports only the shared library (``bench.lib``) and slotserve itself, never another
script; the checkout's root is on the path through the editable install.
"""
