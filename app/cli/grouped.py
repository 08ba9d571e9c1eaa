"""click options in titled sections of ``--help``, and options made from ``app.config.SETTINGS``."""

from __future__ import annotations

import click

from app.config import Setting


class GroupedOption(click.Option):
    """An option that ``GroupedCommand`` lists under ``group`` (None: the command's own options)."""

    def __init__(self, *args, group: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose ``--help`` lists its own options first, then each group under its title."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str | None, list[tuple[str, str]]] = {None: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", None), []).append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title or "Options"):
                    formatter.write_dl(records)


class SettingType(click.ParamType):
    """A setting's value, converted and checked by the setting itself (the message names it)."""

    def __init__(self, setting: Setting):
        self.setting = setting
        kind = type(setting.default)
        if setting.choices:
            self.name = "[" + "|".join(setting.choices) + "]"
        elif kind is bool:
            self.name = "BOOL"
        elif setting.name.endswith("_S"):
            self.name = "SECONDS"
        else:
            self.name = {int: "INT", float: "NUMBER"}.get(kind, "TEXT")

    def convert(self, value, param, ctx):
        try:
            return self.setting.coerce(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def first_sentence(text: str) -> str:
    """The help's first sentence: ``--help`` stays a list; the README explains each setting."""
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def setting_option(setting: Setting, group: str) -> GroupedOption:
    """``--tick-s`` for TICK_S: from the flag, else ``RANKWATCH_TICK_S``, else the default."""
    default = setting.default
    shown = (
        "" if default == "" else f", default {str(default).lower() if isinstance(default, bool) else default}"
    )
    return GroupedOption(
        [setting.flag, setting.name],
        type=SettingType(setting),
        envvar=setting.env,
        default=default,
        help=f"{first_sentence(setting.help).replace('`', '')} ({setting.env}{shown})",
        group=group,
    )
