"""Rankwatch's trainer side: import this in a MindSpore training script.

``GracefulExitBridge`` is loaded lazily so that the dashboard, which shares
``trainer_bridge.rundir.runfiles`` and the checkpoint reader, never imports mindspore.
"""

__all__ = ["GracefulExitBridge", "find_resume_point"]


def __getattr__(name):
    if name in __all__:
        from trainer_bridge import bridge

        return getattr(bridge, name)
    raise AttributeError(f"module 'trainer_bridge' has no attribute {name!r}")
