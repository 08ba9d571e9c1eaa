"""The functional-loop front end: what ``GracefulExitBridge.loop`` runs.

A functional loop (``ms.value_and_grad`` + ``optimizer(grads)``) has no
``Model`` and no callbacks, so the iterator is the hook: each row it yields
is one step, begun when the row is handed over and ended when the next row
is asked for. The time inside the loop body is the in-step time, the time
inside the iterator (data loading) the between-step time, as with the
callback's ``on_train_step_begin`` and ``_end``.
"""

from __future__ import annotations

import logging

from trainer_bridge.engine import Engine

log = logging.getLogger("trainer_bridge")


def rows(engine: Engine, dataset, network, optimizer, epochs: int):
    """Yield ``dataset``'s rows for ``epochs`` epochs, resumed, until done or an agreed stop."""
    if not (isinstance(epochs, int) and epochs >= 1):
        raise ValueError(f"GracefulExitBridge.loop: epochs must be an int >= 1, got {epochs!r}")
    per_epoch = dataset.get_dataset_size()
    batch_size = dataset.get_batch_size() if hasattr(dataset, "get_batch_size") else None
    # The same data position: skip the part of the epoch already trained.
    first_epoch, skip, nothing_left = engine.resume_position(per_epoch, epochs)
    if skip and not nothing_left:
        dataset.set_init_step(skip)  # the first epoch of the next iterator only
    engine.begin(
        [network, optimizer],
        epoch=first_epoch + 1,
        per_epoch=per_epoch,
        global_step=0,
        batch_size=batch_size,
        front_end="loop",
    )
    try:
        if nothing_left:
            return
        iterator = dataset.create_tuple_iterator(num_epochs=epochs - first_epoch)
        counters = engine.counters
        for epoch in range(first_epoch + 1, epochs + 1):
            counters.epoch = epoch
            for row in iterator:
                engine.step_begin()
                yield row
                loss, engine.reported_loss = engine.reported_loss, None
                norm, engine.reported_grad_norm = engine.reported_grad_norm, None
                if engine.step_end(loss, grad_norm=norm):
                    return
    finally:
        engine.end()
