"""``/metrics``: the Prometheus exporter beside its collectors, as glances keeps its exporters.

``exporter.py`` turns one run's view into Prometheus families, ``runs.py``
merges every open run's under ``--runs ROOT`` with a ``run`` label, and
``routes.py`` serves them. It reads the run model and the areas' status;
no area imports it.
"""
