"""What the tests share: the app and its operator (``app``), heartbeats, msrun jobs, a live
server and a browser, network namespaces, a webhook receiver, redis-server, crafted checkpoints.
"""
