"""Commands that run a workload with the probe in it: ``run`` (to a daemon) and ``record`` (to a file)."""

from __future__ import annotations

import argparse

from gpufootprint.cli.common import check_output, command_after_dashes, config_from_args


def cmd_run(args: argparse.Namespace) -> int:
    from gpufootprint import launcher

    config = config_from_args(args, {"daemon.socket": getattr(args, "socket", None)})
    return launcher.run(command_after_dashes(args.cmd), socket_path=config.daemon.socket, probe_config=config.probe)


def cmd_record(args: argparse.Namespace) -> int:
    from gpufootprint import launcher

    config = config_from_args(args)
    command = command_after_dashes(args.cmd)
    check_output("-o", args.output)
    return launcher.record(command, output=args.output, probe_config=config.probe)

