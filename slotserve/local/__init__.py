"""The whole stack on one machine: ``slotserve up`` (engines + gateway) and ``slotserve demo``.

``processes`` starts and supervises child processes, ``stack`` decides what to start (ports,
pool file, Redis), ``workload`` drives requests through the gateway, ``enginestats`` reads the
engines' counters, ``phases`` runs one workload against one pool, ``report`` turns the
measurements into a table and plots.
"""
