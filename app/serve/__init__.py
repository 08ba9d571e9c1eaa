"""The process: the production server (``server.py``, gunicorn's threaded worker with timeouts) and
the bytes of HTTP it reads itself (``httpwire.py``).

It starts the process and is the one importer of ``create_app``: it sits above
the app, where ``app.edge`` (what lies between a socket and a view) sits
below every area's routes.
"""
