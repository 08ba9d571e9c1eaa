"""The process: the production server (``server.py``), its gunicorn worker with timeouts and
connection caps (``worker.py``), and the bytes of HTTP that worker reads itself (``httpwire.py``).

It starts the process and is the one importer of ``create_app``: it sits above
the app, where ``app.edge`` (what lies between a socket and a view) sits
below every area's routes.
"""
