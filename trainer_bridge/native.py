"""Resuming from MindSpore's own ``OnRequestExit`` checkpoint (no bridge).

``OnRequestExit`` saves ``<directory>/rank_<device id>/<file_name>_train.ckpt``
on a graceful exit and, at the next ``on_train_begin``, loads that file into
the train network by itself. It appends ``global_step`` as a scalar, though,
while the optimizer's ``global_step`` has the shape ``(1,)``: its own reload
(and any ``load_checkpoint(..., net=train_net)``) then fails with "global_step
... should have the same shape ... (1,) ... ()", and the relaunch dies.

``on_request_exit_resume`` rewrites that one entry with the optimizer's
shape, once, so the callback's own reload works, and says where training
stopped. The checkpoint browser offers this function's source as the
resume code for an ``OnRequestExit`` set (``app.checkpoints.resume``), so
it imports what it needs inside and uses MindSpore only: a script without
Rankwatch installed can paste it.
"""

from __future__ import annotations


def on_request_exit_resume(path, epochs):
    """Make OnRequestExit's checkpoint at ``path`` loadable; return (initial_epoch, skip_steps).

    ``initial_epoch`` is for ``model.train(epochs, ..., initial_epoch=...)`` and
    ``skip_steps`` for ``dataset.set_init_step`` (the stopped epoch's finished
    batches). (0, 0) without a file. When the file already covers ``epochs``,
    it prints why and returns (epochs, 0): there is nothing to train, so skip
    ``model.train`` (which refuses an ``initial_epoch`` at or past ``epochs``).
    """
    import os

    import mindspore as ms

    if not os.path.isfile(path):
        return 0, 0
    params = ms.load_checkpoint(path)
    step = params.get("global_step")
    if step is not None and step.shape == ():
        # The optimizer's global_step is an int32 of shape (1,): write it so, beside, then swap.
        params["global_step"] = ms.Parameter(ms.Tensor([int(step.asnumpy())], ms.int32), name="global_step")
        tmp = (
            path[: -len(".ckpt")] + ".resume-tmp.ckpt"
            if path.endswith(".ckpt")
            else path + ".resume-tmp.ckpt"
        )
        ms.save_checkpoint([{"name": k, "data": v} for k, v in params.items()], tmp)
        os.replace(tmp, path)
    done = int(params["step_num"].asnumpy()) if "step_num" in params else 0
    per_epoch = int(params["batch_num"].asnumpy()) if "batch_num" in params else 0
    initial_epoch, skip = divmod(done, per_epoch) if per_epoch > 0 else (0, 0)
    if initial_epoch >= epochs:
        print(f"{path} was saved after step {done}, past the {epochs} epochs asked for: nothing to train")
        return epochs, 0
    return initial_epoch, skip
