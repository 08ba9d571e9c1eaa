"""Every line the log reader understands, as data: one place, each with a real example.

A pattern has a ``kind`` (what the line means to the reader), a ``needle``
(a literal every such line contains: ``needle in line`` is a C-speed
prefilter, so a line that matches nothing costs a few substring checks,
not a dozen regular expressions), a regular expression with named groups,
an ``example`` (a line as the program writes it; ``tests/ranks/test_logmode_patterns.py``
parses every example) and ``origin`` (where the format string lives).

The named groups are the vocabulary of ``app.run.logmode.parser``: ``epoch``,
``step`` (within the epoch), ``loss``, ``spe`` (steps per epoch),
``step_ms``, ``pid``, ``rank``, ``node``, ``host``, ``world``, ``code``,
``message``. A pattern whose counters start at 0 says so with ``base=0``.

Three files are read, each with its own list:

* ``worker_N.log``: what rank N's script printed (stdout and stderr);
* ``scheduler.log``: msrun's scheduler (MindSpore's C++ log at WARNING,
  the default ``GLOG_v=2``): who registered, who timed out, who left;
* any other ``*.log`` in the log directory: msrun's own output, when the
  operator redirected it there (``msrun ... > RUN/msrun_logs/msrun.log 2>&1``).

A log is written by the job, so a line may be built to be slow to match.
Every expression is compiled by RE2 (``google-re2``), whose automaton runs
in time linear in the line whatever the pattern, and a line is cut at
``MAX_LINE`` characters before any is tried. RE2 refuses what would need
backtracking (backreferences, lookarounds), so a pattern added here that
needs them fails at import, not in production. Python's ``re`` took about
100 ms on one 4 KiB line against the MindFormers pattern
(``python -m tests.bench.logpatterns`` measures both engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import re2

from app.run.logmode.tailer import MAX_LINE


def _rx(pattern: str) -> Any:
    """RE2's compiled ``pattern``: linear time; raises at import for what RE2 cannot do."""
    return re2.compile(pattern)


@dataclass(frozen=True)
class Pattern:
    kind: str
    needle: str | None  # None: always tried (only while the parser still needs it)
    regex: Any  # RE2's compiled expression (``_rx``)
    example: str
    origin: str
    base: int = 1  # 0 when the line counts epochs and steps from 0
    note: str = ""  # what an error line means, when its words do not say

    def match(self, line: str) -> Any:
        """RE2's match object of ``line`` (cut at ``MAX_LINE``), or None."""
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE]
        if self.needle is not None and self.needle not in line:
            return None
        return self.regex.search(line)


# The prefix of every line MindSpore's loggers write: C++ ("DISTRIBUTED(pid,tid,python)")
# and Python ("ME(pid:tid,MainProcess)"); the first number is the process id.
MS_PREFIX = r"^\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] [A-Z_]+\((?P<pid>\d{1,7})[,:]"
# An exception's last line: a (dotted) class name, then ": message" or nothing.
EXCEPTION = _rx(r"^(?P<type>[A-Za-z_][\w.]{0,200})(?:: (?P<message>.*))?$")

WORKER: tuple[Pattern, ...] = (
    Pattern(
        "step",
        ", loss is ",
        _rx(r"\bepoch: (?P<epoch>\d{1,9}) step: (?P<step>\d{1,12}), loss is (?P<loss>\S+)"),
        "epoch: 1 step: 25, loss is 2.305208206176758",
        "mindspore/train/callback/_loss_monitor.py: "
        'print("epoch: %s step: %s, loss is %s" % (cur_epoch_num, cur_step_in_epoch, loss))',
    ),
    Pattern(
        "step",
        ", loss is ",
        _rx(r"\bepoch: (?P<epoch>\d{1,9}), step: (?P<step>\d{1,12}), loss is (?P<loss>\S+)"),
        "epoch: 0, step: 10, loss is 2.2905269",
        "MindSpore's data-parallel tutorial (docs/sample_code/distributed_data_parallel): "
        'print("epoch: %s, step: %s, loss is %s" % (epoch, i, loss_value)), both from 0',
        base=0,
    ),
    Pattern(
        "step",
        "Epoch:[",
        _rx(
            r"\{ Epoch:\[\s*(?P<epoch>\d{1,9})/\s*\d+\], step:\[\s*(?P<step>\d{1,12})/\s*(?P<spe>\d{1,12})\], "
            r"loss:\s*\[?\s*(?P<loss>[^,/\]\s]+)[^,]*, .*?per_step_time: (?P<step_ms>\d{1,12})ms"
        ),
        "2025-03-04 10:21:33,123 - mindformers[mindformers/core/callback/callback.py:556] - INFO - "
        "{ Epoch:[  1/  2], step:[    5/  100], loss:[10.253/10.301], per_step_time: 1234ms, "
        "lr: 1e-05, overflow cond: False, loss_scale: 1.0, global_norm: [1.52], "
        "train_throughput_per_npu: 12.345T",
        "mindspore-lab/mindformers mindformers/core/callback/callback.py, MFLossMonitor.print_output_info: "
        '"{ Epoch:[%3d/%3d], step:[%5d/%5d], " + loss + "per_step_time: %dms, lr: %s, overflow cond: %s, '
        'loss_scale: %s, global_norm: %s%s" (loss is "loss: %5.3f, " in sink mode)',
    ),
    Pattern(
        "step_time",
        "per step time: ",
        _rx(r"^(?:Train)? ?epoch time: [\d.]+ ms, per step time: (?P<step_ms>[\d.]{1,20}) ms"),
        "Train epoch time: 8318.583 ms, per step time: 831.858 ms",
        "mindspore/train/callback/_time_monitor.py: "
        '"{} epoch time: {:5.3f} ms, per step time: {:5.3f} ms".format(mode.title(), ...)',
    ),
    Pattern(
        "traceback",
        "Traceback (most recent call last)",
        _rx(r"^Traceback \(most recent call last\):"),
        "Traceback (most recent call last):",
        "CPython's traceback module",
    ),
    Pattern(
        "error",
        "[ERROR] ",
        _rx(MS_PREFIX + r"[^)]*\):\S+ \[[^\]]{1,300}\] (?:\w{1,100}\] )?(?P<message>.+)$"),
        "[ERROR] DISTRIBUTED(10208,7f2904429b80,python):2026-11-23-08:57:58.163.543 "
        "[mindspore/ccsrc/cluster/topology/meta_server_node.cc:95] Finalize] "
        "There are 1 abnormal compute graph nodes.",
        "MindSpore's C++ and Python loggers: [LEVEL] MODULE(pid,...):time [file:line] function] message",
    ),
    Pattern(
        "error",
        "Kill this process with SIGTERM",
        _rx(
            MS_PREFIX
            + r"[^)]*\):\S+ \[[^\]]{1,300}\] (?:\S{1,100}\] )?(?P<message>Kill this process with SIGTERM\.?)"
        ),
        "[WARNING] DISTRIBUTED(14320,7fdcfaffd6c0,python):2026-11-23-09:05:32.406.049 "
        "[mindspore/ccsrc/cluster/init.cc:135] operator()] Kill this process with SIGTERM.",
        "mindspore/ccsrc/cluster/init.cc: the cluster's exception callback",
        note="MindSpore ended this rank because its cluster failed: a peer rank or msrun's scheduler is gone",
    ),
    Pattern(
        "error",
        "RuntimeError: ",
        _rx(r"^(?P<message>RuntimeError: .+)$"),
        "RuntimeError: The total number of timed out node is 1. Timed out node list is: "
        "[const vector]{0}, worker 0 is the first one timed out, please check its log.",
        "MindSpore's C++ exceptions reach Python as RuntimeError",
    ),
    Pattern(
        "graceful_exit",
        "Graceful exit is triggered",
        _rx(r"(?P<message>Graceful exit is triggered, stop training\.?)"),
        "[WARNING] ME(4242:140080786361216,MainProcess):2026-11-23-09:10:01.482.000 "
        "[mindspore/train/callback/_on_request_exit.py:240] Graceful exit is triggered, stop training.",
        'mindspore/train/callback/_on_request_exit.py: logger.warning("Graceful exit is triggered, stop training.")',
    ),
    Pattern(
        "on_request_exit",
        "Gracefully exiting training process",
        _rx(r"(?P<message>Gracefully exiting training process on step end\.?)"),
        "[INFO] ME(4242:140080786361216,MainProcess):2026-11-23-09:10:01.470.000 "
        "[mindspore/train/callback/_on_request_exit.py:235] Gracefully exiting training process on step end.",
        'mindspore/train/callback/_on_request_exit.py: logger.info("Gracefully exiting training process on step end.")',
    ),
    Pattern(
        "on_request_exit",
        "please check json file: ",
        _rx(r"(?P<message>Parse json file failed: .*please check json file: .+)$"),
        "[WARNING] ME(4242:140080786361216,MainProcess):2026-11-23-09:10:01.470.000 "
        "[mindspore/train/callback/_on_request_exit.py:294] Parse json file failed: Expecting value: "
        "line 1 column 1 (char 0), please check json file: /runs/job/graceful_exit.json",
        'mindspore/train/callback/_on_request_exit.py: logger.warning(f"Parse json file failed: {e}, '
        'please check json file: {self.remote_config_file}")',
    ),
    Pattern(
        "rank_id",
        " rank id: ",
        _rx(r"PostProcess\] This node \S+ rank id: (?P<rank>\d{1,7})$"),
        "[WARNING] DISTRIBUTED(10211,7f06cce68b80,python):2026-11-23-08:57:03.534.234 "
        "[mindspore/ccsrc/cluster/topology/cluster_context.cc:428] PostProcess] This node 1 rank id: 1",
        "mindspore/ccsrc/cluster/topology/cluster_context.cc (GLOG_v<=2)",
    ),
    # Tried on every line that starts with "[" until the worker's pid is known.
    Pattern(
        "pid",
        None,
        _rx(MS_PREFIX),
        "[WARNING] DEVICE(10211,7f06cce68b80,python):2026-11-23-08:57:03.534.334 "
        "[mindspore/ccsrc/plugin/cpu/res_manager/collective/allreduce_impl.cc:54] Initialize] "
        "The worker node start sync start!",
        "MindSpore's loggers: the first number in MODULE(pid,...)",
    ),
)

SCHEDULER: tuple[Pattern, ...] = (
    Pattern(
        "registered",
        "is registered successfully",
        _rx(
            r"The new node: (?P<node>\S{1,200})\(role: MS_WORKER\), rank id: (?P<rank>\d{1,7}), "
            r"device id: \d+, hostname: (?P<host>\S{1,253}), ip: \S+ is registered successfully\. "
            r"Currently registered node number: \d+, expected node number: (?P<world>\d{1,7})"
        ),
        "[WARNING] DISTRIBUTED(11650,7f873f2ff6c0,python):2026-11-23-09:00:02.263.946 "
        "[mindspore/ccsrc/cluster/topology/meta_server_node.cc:254] ProcessRegister] The new node: "
        "0(role: MS_WORKER), rank id: 0, device id: 0, hostname: vm, ip: 127.0.0.1 is registered "
        "successfully. Currently registered node number: 1, expected node number: 2",
        "mindspore/ccsrc/cluster/topology/meta_server_node.cc ProcessRegister",
    ),
    Pattern(
        "timed_out",
        "is timed out",
        _rx(r"(?P<message>The node: (?P<node>\S{1,200}) is timed out\..*)$"),
        "[ERROR] DISTRIBUTED(10208,7f28d5cfd6c0,python):2026-11-23-08:57:57.299.501 "
        "[mindspore/ccsrc/cluster/topology/meta_server_node.cc:548] UpdateTopoState] The node: 0 is "
        "timed out. It may exit with exception, please check this node's log.",
        "mindspore/ccsrc/cluster/topology/meta_server_node.cc UpdateTopoState",
    ),
    Pattern(
        "unregistered",
        "has unregistered",
        _rx(r"ProcessUnregister\] Node (?P<node>\S{1,200}) has unregistered"),
        "[WARNING] DISTRIBUTED(11650,7f873f2ff6c0,python):2026-11-23-09:00:30.365.573 "
        "[mindspore/ccsrc/cluster/topology/meta_server_node.cc:323] ProcessUnregister] Node 0 has unregistered.",
        "mindspore/ccsrc/cluster/topology/meta_server_node.cc ProcessUnregister (a worker's clean finalize)",
    ),
)

LAUNCHER: tuple[Pattern, ...] = (
    Pattern(
        "start_worker",
        "Start worker process with rank id:",
        _rx(r"^Start worker process with rank id:(?P<rank>\d{1,7}), log file:(?P<message>\S+)\. "),
        "Start worker process with rank id:1, log file:/runs/job/msrun_logs/worker_1.log. Environment "
        "variable [RANK_ID=1] is exported. Execute command: python train.py --epochs 3",
        "mindspore/parallel/cluster/process_entity/_api.py _start_single_worker (print)",
    ),
    Pattern(
        "worker_exit",
        "exit with exception",
        _rx(
            r"(?P<message>Worker process (?P<pid>\d{1,7}) exit with exception\. Error code: (?P<code>-?\d{1,4})\.)"
        ),
        "[ERROR] ME(10154:140454427835264,MainProcess):2026-11-23-08:57:27.570.000 "
        "[mindspore/parallel/cluster/process_entity/_api.py:365] Worker process 10211 exit with "
        "exception. Error code: -9.",
        'mindspore/parallel/cluster/process_entity/_api.py: logger.error(f"Worker process {p.pid} '
        'exit with exception. Error code: {ret_code}.")',
    ),
    Pattern(
        "kill_all",
        "kill all other workers",
        _rx(r"(?P<message>There's worker exits with exception, kill all other workers\.)"),
        "[WARNING] ME(10154:140454427835264,MainProcess):2026-11-23-08:57:27.570.000 "
        "[mindspore/parallel/cluster/process_entity/_api.py:370] There's worker exits with exception, "
        "kill all other workers.",
        "mindspore/parallel/cluster/process_entity/_api.py join_processes",
    ),
)

# Which list reads which file (app.run.logmode.reader decides a file's role by its name).
BY_ROLE = {"worker": WORKER, "scheduler": SCHEDULER, "launcher": LAUNCHER}
