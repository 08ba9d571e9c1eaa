"""The demo: a real ``msrun`` CPU job (LeNet5 on synthetic MNIST files) with the bridge attached.

``python -m trainer_bridge.demo`` (or ``rankwatch demo``) launches it; see
``__main__.py``. It needs the ``trainer`` extra (``pip install 'rankwatch[trainer]'``).
"""
