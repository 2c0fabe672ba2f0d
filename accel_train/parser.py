"""Every command's argparse parser: errors as one line (ConfigError), defaults shown where they say
something."""

from __future__ import annotations

import argparse

from .errors import ConfigError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its text, except where it has none to show (None: the text says
    what happens then, and "(default: None)" after it only contradicts it)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (ConfigError) instead of usage + exit; every
    command's parser (cli, evaluate, predict, preflight) is one of these, its help shown by
    HelpFormatter."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")
