"""What the benchmark scripts share: engines on one model (``engine``), quality against a
reference (``quality``), plots (``plots``) and local services (``services``)."""
